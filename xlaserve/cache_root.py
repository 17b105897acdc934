"""xlaserve's cache root, under which the compiled programs (runtime/compile/persistent_cache.py,
runtime/compile/executable_cache.py), converted models (weights/conversion_cache.py) and native kernels
(native/build.py) are kept: $XLASERVE_CACHE_DIR, else $XDG_CACHE_HOME/xlaserve, else
~/.cache/xlaserve.

Each of those folders goes through `private_dir`: they hold what this process runs or unpickles
(executables, shared libraries, pickled programs), so one that another user can write to is not
used at all, neither read nor written."""
from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def xlaserve_cache_dir() -> str:
    if os.environ.get("XLASERVE_CACHE_DIR"):
        return os.environ["XLASERVE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "xlaserve")


def private_dir(path: str | os.PathLike) -> Path | None:
    """`path`, created 0700 if absent (its missing parents as `mkdir -p` makes them), if only this
    user can write in it; else None, with a warning: the caller then caches nothing there (and
    compiles or converts afresh). Refused: a folder writable by group or others, or owned by
    another user (who could plant a program or a pickle for this process to load)."""
    path = Path(path).expanduser()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as error:
        logger.warning("Cache folder %s is not writable (%s); not caching there", path, error)
        return None
    if info.st_uid != os.getuid():
        problem = f"is owned by another user (uid {info.st_uid})"
    elif info.st_mode & 0o022:
        problem = f"is writable by other users (mode {info.st_mode & 0o777:o}; chmod go-w fixes it)"
    else:
        return path
    logger.warning("Cache folder %s %s: not using it, every program or model is built afresh",
                   path, problem)
    return None
