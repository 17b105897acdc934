"""The stages of serving a step, each a folder: the engine loop (engine), what runs in the next
step (scheduler), the step on the device (executor), what a token is drawn from (sampling),
several hosts (distributed), compiled programs kept between starts (compile) and the host's
memory (host)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "compile": "compile",
    "distributed": "distributed",
    "engine": "engine",
    "executor": "executor",
    "host": "host",
    "sampling": "sampling",
    "scheduler": "scheduler",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
