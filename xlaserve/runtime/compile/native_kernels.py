"""The native CPU kernels (xlaserve/native/build.py) a compiled program calls, kept with it in the
executable cache and registered before it is loaded.

XLA binds each custom call of an executable to its FFI handler when the executable is
deserialized, and a kernel's handler is registered when a step calling it is traced (each
kernel's Python function builds and registers it). A warm start traces nothing, so an entry whose
program calls a kernel that nothing else at start-up had registered failed to load ("No FFI
handler registered for xlaserve_q8_gemm_cpu": the default model's Q8 GEMM) and was compiled
again: 44.3 s of a 51.5 s warm start of `make serve` (issue 71). Each entry therefore names the
kernels its program calls (`kernels_called`, read from the compiled program's text: ~10 ms), and
`register_kernels` registers them first: a kernel no program calls is neither built nor loaded.
"""
from __future__ import annotations

import re
import threading

from xlaserve.native.build import Registration, registered

_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')  # in the compiled program's HLO text
_REGISTERING = threading.Lock()  # entries load on threads; build.register is not made for that


def kernels_called(compiled) -> tuple[Registration, ...]:
    """The registrations, made in this process, of the native kernels `compiled` (a jax
    Compiled) calls: XLA's own custom calls (TopK, ...) are not ours and need none."""
    targets = set(_CUSTOM_CALL.findall(compiled.as_text() or ""))
    return tuple(registration for name, registration in sorted(registered().items())
                 if name in targets)


def register_kernels(kernels: tuple[Registration, ...]) -> None:
    """Registers each of `kernels` in this process (once each: build.register is cached), built
    first where this machine's kernel cache lacks it; raises KernelUnavailable."""
    with _REGISTERING:
        for registration in kernels:
            registration.again()
