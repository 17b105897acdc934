"""The files and batches APIs: their routes (`files`, `routes`), the `BatchRunner` that runs a
batch's lines, and `Storage`, their durable state under --file-storage-path."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "files": "files",
    "routes": "routes",
    "BatchRunner": "runner", "default_concurrency": "runner",
    "Storage": "storage", "DEFAULT_ROOT": "storage", "default_folder": "storage",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
