"""The LoRA flags, and their reading: SGLang's `--lora-paths` forms and vLLM's `--lora-modules`
(one list) into {name: path} (`lora_paths_of`), `--enable-lora` implied by an adapter, the
counts checked (LoraFlags.resolve_lora, which ServerArgs.__post_init__ calls). What cannot run
beside adapters: conflicts.py. The slots' shapes (rank, targets) are decided at start-up, once the
initial adapters are read (runtime/engine/startup.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

from xlaserve.server_args.flag import flag

# The PEFT target modules an adapter may have (model/lora.py's PROJECTIONS fuse them).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

DEFAULT_MAX_RANK = 16  # vLLM's default --max-lora-rank, where no adapter is given at start
# An adapter's name: what a request's model field or lora_path carries.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$")


@dataclasses.dataclass
class LoraFlags:
    """LoRA adapters (runtime/engine/lora_adapters.py)."""

    enable_lora: bool = flag(
        False, "serve LoRA adapters: requests pick one with lora_path or model BASE:NAME (or "
               "NAME); implied by --lora-paths")
    lora_paths: Optional[list[str]] = flag(
        None, "adapters loaded at start: NAME=PATH (a PEFT adapter directory or hub id), a bare "
              "PATH (named by its last folder; a hub id by itself), or JSON {\"lora_name\": ..., \"lora_path\": ...}",
        nargs="*", aliases=("--lora-modules",))
    max_loras_per_batch: int = flag(
        8, "adapter slots on the device: the most adapters in one batch (and in the slots) at "
           "once", aliases=("--max-loras",))
    max_loaded_loras: Optional[int] = flag(
        None, "the most adapters loaded at once, kept in host memory: those beyond the slots are "
              "written into a slot (its least recently used adapter's, once no running request "
              "uses it) when a request needs them; at least --max-loras-per-batch (default: "
              "--max-loras-per-batch)", aliases=("--max-cpu-loras",))
    max_lora_rank: Optional[int] = flag(
        None, "every adapter's rank padded to this; a larger one is refused (default: the "
              "largest of --lora-paths, else 16)")
    lora_target_modules: Optional[list[str]] = flag(
        None, "modules adapters may target, of q_proj k_proj v_proj o_proj gate_proj up_proj "
              "down_proj, or all (default: those --lora-paths target, else all)", nargs="*")

    def resolve_lora(self) -> None:
        """--enable-lora implied by adapters; the flags' forms and counts checked."""
        paths = lora_paths_of(self.lora_paths)
        target_modules_of(self.lora_target_modules)
        if paths:
            self.enable_lora = True
        if not self.enable_lora:
            return
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be 1 or more; got "
                             f"{self.max_loras_per_batch}")
        if self.max_loaded_loras is None:
            self.max_loaded_loras = self.max_loras_per_batch
        if self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(f"--max-loaded-loras {self.max_loaded_loras} is under "
                             f"--max-loras-per-batch {self.max_loras_per_batch}: give at least "
                             "as many")
        if len(paths) > self.max_loaded_loras:
            raise ValueError(f"--lora-paths names {len(paths)} adapters; --max-loaded-loras "
                             f"{self.max_loaded_loras} (default: --max-loras-per-batch) are "
                             "loaded at most")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be 1 or more; got {self.max_lora_rank}")


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
