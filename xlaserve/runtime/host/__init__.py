"""The host's memory under a CPU step: the weights on 2 MiB pages (`advise_huge_pages`) and
glibc's settings that keep the step's buffers mapped between steps (`malloc_tuning`)."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "advise_huge_pages": "huge_pages",
    "malloc_tuning": "malloc_tuning",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
