"""The LoRA flags of ServerArgs resolved (`resolve_lora`, which ServerArgs.__post_init__ calls):
SGLang's `--lora-paths` forms and vLLM's `--lora-modules` (one list) into {name: path},
`--enable-lora` implied by an adapter, and what cannot run beside adapters stops start-up naming
it. The slots' shapes (rank, targets) are decided at start-up, once the initial adapters are read
(runtime/engine/startup.py)."""
from __future__ import annotations

import json
import os
import re

# The PEFT target modules an adapter may have (model/lora.py's PROJECTIONS fuse them).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

DEFAULT_MAX_RANK = 16  # vLLM's default --max-lora-rank, where no adapter is given at start
# An adapter's name: what a request's model field or lora_path carries.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$")


def lora_paths_of(entries: list[str] | None) -> dict[str, str]:
    """{name: path} from `--lora-paths` / `--lora-modules` entries: `NAME=PATH`, a bare `PATH`
    (named by its last folder, or a hub id by itself), or JSON `{"lora_name": ..., "lora_path": ...}` (SGLang) or
    `{"name": ..., "path": ...}` (vLLM)."""
    out: dict[str, str] = {}
    for entry in entries or []:
        entry = entry.strip()
        if entry.startswith("{"):
            try:
                item = json.loads(entry)
            except json.JSONDecodeError as err:
                raise ValueError(f"--lora-paths {entry!r}: not JSON ({err})") from None
            # SGLang's "pinned" asks nothing more: every adapter stays in its slot until unloaded
            name = item.get("lora_name", item.get("name"))
            path = item.get("lora_path", item.get("path"))
        elif "=" in entry:
            name, path = entry.split("=", 1)
        else:  # named by its last folder: a path on this disk is nothing a client sees
            path = entry
            name = os.path.basename(os.path.normpath(entry)) if os.path.exists(
                os.path.expanduser(entry)) or entry.startswith(("/", ".", "~")) else entry
        if not isinstance(name, str) or not isinstance(path, str) or not _NAME.match(name):
            raise ValueError(f"--lora-paths {entry!r}: give NAME=PATH (a name of letters, digits "
                             "and ._-/, at most 128)")
        if name in out:
            raise ValueError(f"--lora-paths: the name {name!r} is given twice")
        out[name] = path
    return out


def check_adapter_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"LoRA adapter name {str(name)[:64]!r}: letters, digits and ._-/, at "
                         "most 128")


def target_modules_of(entries: list[str] | None) -> tuple[str, ...] | None:
    """--lora-target-modules: module names, or "all"; None when not given."""
    if not entries:
        return None
    names = [n for entry in entries for n in entry.replace(",", " ").split()]
    if "all" in names or "all-linear" in names:
        return TARGET_MODULES
    unknown = [n for n in names if n not in TARGET_MODULES]
    if unknown:
        raise ValueError(f"--lora-target-modules {' '.join(unknown)}: supported are "
                         f"{', '.join(TARGET_MODULES)} and all")
    return tuple(names)


def resolve_lora(args) -> None:
    """--enable-lora implied by adapters; the flags' forms checked; what cannot run with
    adapters refused."""
    paths = lora_paths_of(args.lora_paths)
    target_modules_of(args.lora_target_modules)
    if paths:
        args.enable_lora = True
    if not args.enable_lora:
        return
    if args.max_loras_per_batch < 1:
        raise ValueError(f"--max-loras-per-batch must be 1 or more; got {args.max_loras_per_batch}")
    if len(paths) > args.max_loras_per_batch:
        raise ValueError(f"--lora-paths names {len(paths)} adapters; --max-loras-per-batch "
                         f"{args.max_loras_per_batch} slots hold them")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be 1 or more; got {args.max_lora_rank}")
    for flag, value in (("--speculative-algorithm", args.speculative_algorithm),
                        ("--dp-size > 1", args.dp_size > 1), ("--nnodes > 1", args.nnodes > 1)):
        if value:
            raise ValueError(f"--enable-lora with {flag} is not supported")
