"""The suite compiles its CPU programs at LLVM's -O0 (tests/conftest.py), to halve a cold run's
compiles: the optimized program is the one a server runs, only its machine code differs. This
checks both on a tiny model's serving step."""
import re

import jax
import pytest

from tests.executor.test_model_runner import BUCKETS, PAGE_SIZE
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.runtime.executor.model_runner import ModelRunner
from xlaserve.runtime.sampling.step_needs import EVERYTHING
from xlaserve.weights.loader import load_model

DEFAULT_LEVEL = 3  # XLA's default xla_backend_optimization_level: a server's


def _hlo(compiled) -> str:
    return re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())


def test_cpu_programs_compile_at_o0_to_the_optimized_hlo_of_the_default_level(tmp_path):
    from jax._src import compiler

    options = compiler.get_compile_options(1, 1, backend=jax.devices("cpu")[0].client)
    assert options.executable_build_options.debug_options.xla_backend_optimization_level == 0

    make_tiny_checkpoint(str(tmp_path), "llama")
    loaded = load_model(str(tmp_path), dtype="float32", skip_tokenizer_init=True, progress=False)
    runner = ModelRunner(loaded, num_pages=16, page_size=PAGE_SIZE, max_running_requests=4)
    args, kwargs = runner._lowering_args(BUCKETS.all_shapes()[-1], EVERYTHING)
    lowered = runner._step.trace(*args, **kwargs).lower()
    at_o0 = lowered.compile()
    at_default = lowered.compile({"xla_backend_optimization_level": DEFAULT_LEVEL})
    assert _hlo(at_o0) == _hlo(at_default)
    assert "custom-call" in _hlo(at_o0) or "fusion" in _hlo(at_o0)  # a real step, not an empty one


if __name__ == "__main__":
    pytest.main([__file__])
