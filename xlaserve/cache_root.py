"""xlaserve's cache root, under which the compiled programs (runtime/compilation.py,
runtime/executable_cache.py), converted models (model/conversion_cache.py) and native kernels
(native/__init__.py) are kept: $XLASERVE_CACHE_DIR, else $XDG_CACHE_HOME/xlaserve, else
~/.cache/xlaserve."""
from __future__ import annotations

import os


def xlaserve_cache_dir() -> str:
    if os.environ.get("XLASERVE_CACHE_DIR"):
        return os.environ["XLASERVE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlaserve")
