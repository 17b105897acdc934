"""ServerArgs: every command-line flag, with SGLang's flag names, in one flat dataclass made of
the areas' dataclasses (model_flags.py ... batch_flags.py). Callers see one object
(`args.tp_size`, `ServerArgs(**kwargs)`, `dataclasses.replace`), and --help one list of flags,
in the areas' order. Making one checks it: each area resolves and checks its own flags, and
what does not combine (conflicts.py) is refused."""
from __future__ import annotations

import argparse
import dataclasses

from xlaserve.server_args.batch_flags import BatchFlags
from xlaserve.server_args.cache_and_grammar_flags import CacheAndGrammarFlags
from xlaserve.server_args.conflicts import Mode, refuse_conflicts
from xlaserve.server_args.disk_cache_flags import DiskCacheFlags
from xlaserve.server_args.flag import add_to_parser, public_name, serve_value_aliases, values_of
from xlaserve.server_args.http_flags import HttpFlags
from xlaserve.server_args.kernel_flags import KernelFlags
from xlaserve.server_args.lora_flags import LoraFlags, lora_paths_of
from xlaserve.server_args.image_flags import ImageFlags
from xlaserve.server_args.model_flags import ModelFlags, reranker_tokens
from xlaserve.server_args.output_flags import OutputFlags
from xlaserve.server_args.parallel_flags import ParallelFlags
from xlaserve.server_args.request_flags import RequestFlags
from xlaserve.server_args.scheduling_flags import SchedulingFlags
from xlaserve.server_args.speculative_flags import SpeculativeFlags

# The areas in --help's order. A dataclass takes the fields of its last base first, so
# ServerArgs lists them reversed: its fields, and --help, then read in this order.
AREAS = (ModelFlags, OutputFlags, ImageFlags, KernelFlags, ParallelFlags, DiskCacheFlags,
         SchedulingFlags, LoraFlags, SpeculativeFlags, CacheAndGrammarFlags, RequestFlags,
         HttpFlags, BatchFlags)


@dataclasses.dataclass
class ServerArgs(*reversed(AREAS)):
    def __post_init__(self):
        """SGLang's and vLLM's value names become ours; what cannot run stops here. The steps
        run in this order, so that of two problems the same one is always reported first."""
        serve_value_aliases(self)
        self.check_request_limits()
        self.check_precompile()
        self._resolve_runner()
        self.resolve_speculative()
        self.resolve_lora()
        if self.enable_lora:
            refuse_conflicts(self, Mode.LORA)
        if self.runner == "pooling":
            refuse_conflicts(self, Mode.EMBEDDINGS)
        if self.enable_return_hidden_states:
            refuse_conflicts(self, Mode.HIDDEN_STATES)
        if self.enable_deterministic_inference:
            refuse_conflicts(self, Mode.DETERMINISTIC)
        if self.enable_hierarchical_cache:
            self.check_host_tier()
            refuse_conflicts(self, Mode.HIERARCHICAL_CACHE)
        self.check_mla_expanded_prefill()
        self.check_mamba_cache()

    def _resolve_runner(self) -> None:
        """A decoder reranker (--hf-overrides) and --is-embedding are pooling servers."""
        if reranker_tokens(self) is not None:
            refuse_conflicts(self, Mode.RERANKER)
            self.runner = "pooling"
        if self.is_embedding:
            refuse_conflicts(self, Mode.IS_EMBEDDING)
            self.runner = "pooling"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_to_parser(parser, dataclasses.fields(cls))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**values_of(args, dataclasses.fields(cls)))

    def redacted(self) -> "ServerArgs":
        """A copy fit to log (the start-up line shows the paths the operator typed): each secret
        that is set is "***"."""
        return dataclasses.replace(self, **{f.name: "***" for f in dataclasses.fields(self)
                                            if f.metadata.get("secret") and getattr(self, f.name)})

    def served(self) -> "ServerArgs":
        """A copy fit to serve (/get_server_info): redacted, and each path by its name only
        (--lora-paths as NAME=name of its path)."""
        redacted = self.redacted()
        adapters = self.lora_paths and [f"{name}={public_name(path)}" for name, path in
                                        lora_paths_of(self.lora_paths).items()]
        return dataclasses.replace(redacted, lora_paths=adapters, **{
            f.name: public_name(getattr(redacted, f.name))
            for f in dataclasses.fields(self) if f.metadata.get("path")})
