"""The caches on disk: compiled programs (JAX's persistent cache, the serving steps'
executables) and converted GGUF models."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class DiskCacheFlags:
    """What later starts may reuse from this one."""

    compilation_cache_dir: Optional[str] = flag(
        None, "JAX persistent compilation cache, and in its `executables` folder the serving "
              "steps compiled (default: $XLASERVE_CACHE_DIR/xla, else ~/.cache/xlaserve/xla)",
        path=True)
    disable_executable_cache: bool = flag(
        False, "trace and lower every serving step at start-up (JAX's persistent cache still "
               "skips the compiles) instead of loading the compiled steps a previous start "
               "stored; XLASERVE_EXECUTABLE_CACHE=0 does the same")
    conversion_cache_dir: Optional[str] = flag(
        None, "where converted models (a GGUF file's dequantized weights, config and tokenizer) "
              "are kept so later starts skip the conversion (default: "
              "$XLASERVE_CONVERSION_CACHE_DIR, else $XLASERVE_CACHE_DIR/converted, else "
              "$XDG_CACHE_HOME/xlaserve/converted, else ~/.cache/xlaserve/converted)",
        path=True)
    disable_conversion_cache: bool = flag(
        False, "convert a GGUF model on every start instead of loading it from (and writing it "
               "to) the conversion cache")
