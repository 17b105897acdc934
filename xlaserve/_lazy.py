"""The lazy re-export of every folder's `__init__.py` (PEP 562): a folder's public names are read
from the modules that define them on first use, so `from xlaserve.runtime.engine import
EngineCore` works and importing one module of a folder imports none of its others."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, module_of: dict[str, str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module `__getattr__` and `__dir__` of `package`, whose public names are the keys of
    `module_of`, each defined in the submodule its value names (a name equal to its value is
    that submodule, or subfolder, itself)."""

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{module_of[name]}")
        return module if module_of[name] == name else getattr(module, name)

    def __dir__() -> list[str]:
        return sorted(module_of)

    return __getattr__, __dir__
