"""OpenAI's Responses API at /v1/responses: `router` (routes.py) and `ResponseStore` (store.py),
which the app builds on the files and batches storage."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "router": "routes",
    "ResponseStore": "store",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
