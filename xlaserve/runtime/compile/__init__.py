"""Compiled programs kept between starts: JAX's persistent compilation cache
(`enable_persistent_cache`) and the serving steps stored compiled (`ExecutableCache`)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "describe": "executable_cache", "enabled_by_environment": "executable_cache",
    "ExecutableCache": "executable_cache", "compile_on_threads": "executable_cache",
    "enable_persistent_cache": "persistent_cache",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
