"""The speculative-decoding flags, and their resolution (SpeculativeFlags.resolve_speculative,
which ServerArgs.__post_init__ calls): vLLM's --speculative-config JSON onto SGLang's flags, the
defaults that depend on one another (a chain's or a tree's row of tokens), and the bounds;
anything not built stops start-up naming it. What cannot run beside speculation: conflicts.py."""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class SpeculativeFlags:
    """Speculative decoding (runtime/scheduler/speculation.py)."""

    speculative_algorithm: Optional[str] = flag(
        None, "speculative decoding: NGRAM drafts each request's next tokens from its own prompt "
              "and output (no draft model), STANDALONE with a small draft model of the same "
              "tokenizer (--speculative-draft-model-path), EAGLE3 (or EAGLE) with an EAGLE-3 "
              "head fed the model's hidden states (--speculative-draft-model-path), NEXTN with "
              "the checkpoint's own multi-token-prediction layer (DeepSeek-V3/R1's, "
              "Qwen3-Next's, Qwen3.5's); the model "
              "verifies the drafts in one step; greedy output is unchanged and sampled output "
              "keeps the model's distribution",
        choices=["NGRAM", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE"],
        value_aliases={"ngram": "NGRAM"})
    speculative_draft_model_path: Optional[str] = flag(
        None, "STANDALONE: the draft model (a directory, hub id or .gguf file, as "
              "--model-path), loaded with the model's --dtype and --quantization; its "
              "vocabulary must be the model's. EAGLE3: the head's directory or hub id "
              "(config.json and safetensors, as SGLang loads)", path=True)
    speculative_num_steps: Optional[int] = flag(
        None, "EAGLE3 / NEXTN: draft steps per verified row, SGLang's (a chain: "
              "--speculative-num-draft-tokens is this plus one; a tree: its depth, default 3)")
    speculative_eagle_topk: Optional[int] = flag(
        None, "EAGLE3 / NEXTN: drafts kept per step, SGLang's; 1: a chain; more: a "
              "tree, the likeliest --speculative-num-draft-tokens - 1 nodes of a beam of this "
              "many paths, verified in one row (topk x steps <= 32)")
    speculative_num_draft_tokens: Optional[int] = flag(
        None, "tokens per verified row, the last accepted token included, as SGLang's: a row "
              "checks this many less one drafted tokens (default 5)")
    speculative_ngram_min_match_window_size: int = flag(
        1, "NGRAM: the shortest run of a request's last tokens looked up in its earlier tokens")
    speculative_ngram_max_match_window_size: int = flag(
        12, "NGRAM: the longest such run (the longest match found is drafted from)")
    speculative_disable_by_batch_size: Optional[int] = flag(
        None, "decode without speculation while more than this many requests run (vLLM's "
              "disable_by_batch_size; default 32): where the batch already fills the device, a "
              "verified row costs more than it gains (measured, 2-core CPU: copying text, 1.9x "
              "faster at 32 running, 0.57x at 64; on an H200 a 5-token row cost 1.75x a decode "
              "step at 32 rows)")
    speculative_config: Optional[str] = flag(
        None, "vLLM's form, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 12, "
              "\"disable_by_batch_size\": 16}; sets the flags above")

    def resolve_speculative(self) -> None:
        """vLLM's --speculative-config onto SGLang's flags, the default draft length, and the
        bounds; anything not built stops start-up naming it."""
        if self.speculative_config:
            self._apply_speculative_config(self.speculative_config)
        if self.speculative_algorithm is None:
            return
        algorithm = self.speculative_algorithm
        if algorithm == "EAGLE":  # SGLang's EAGLE runs EAGLE-3 heads too; EAGLE-1/2 are refused
            algorithm = self.speculative_algorithm = "EAGLE3"  # by the head's architecture
        needs_path = algorithm in ("STANDALONE", "EAGLE3")
        if needs_path != bool(self.speculative_draft_model_path):
            raise ValueError("--speculative-draft-model-path goes with --speculative-algorithm "
                             "STANDALONE (a draft model) or EAGLE3 (its head), and they need it; "
                             "NEXTN reads the model's own checkpoint")
        self._resolve_draft_steps(algorithm)
        if self.speculative_num_draft_tokens is None:
            self.speculative_num_draft_tokens = 5
        if self.speculative_num_draft_tokens < 2:
            raise ValueError("--speculative-num-draft-tokens must be 2 or more (the last token "
                             f"and a draft); got {self.speculative_num_draft_tokens}")
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError("--speculative-ngram-min-match-window-size and -max- must satisfy "
                             f"1 <= min <= max; got {low} and {high}")
        if self.speculative_disable_by_batch_size is None:
            self.speculative_disable_by_batch_size = 32
        if self.speculative_disable_by_batch_size < 1:
            raise ValueError("--speculative-disable-by-batch-size must be 1 or more; got "
                             f"{self.speculative_disable_by_batch_size}")

    def _resolve_draft_steps(self, algorithm: str) -> None:
        """SGLang's EAGLE flags: --speculative-num-steps, which sets a chain's row tokens (steps
        + 1), and --speculative-eagle-topk, which makes the drafts a tree (`_resolve_tree`)."""
        head = algorithm in ("EAGLE3", "NEXTN")
        if not head and (self.speculative_num_steps is not None
                         or self.speculative_eagle_topk is not None):
            raise ValueError("--speculative-num-steps and --speculative-eagle-topk go with "
                             "--speculative-algorithm EAGLE3 or NEXTN")
        if self.speculative_eagle_topk is not None and self.speculative_eagle_topk < 1:
            raise ValueError("--speculative-eagle-topk must be 1 or more; got "
                             f"{self.speculative_eagle_topk}")
        if (self.speculative_eagle_topk or 1) > 1:
            self._resolve_tree()
            return
        steps = self.speculative_num_steps
        if steps is None:
            return
        if steps < 1:
            raise ValueError(f"--speculative-num-steps must be 1 or more; got {steps}")
        if self.speculative_num_draft_tokens not in (None, steps + 1):
            raise ValueError(f"--speculative-num-steps {steps} with --speculative-eagle-topk 1 "
                             f"makes rows of {steps + 1} tokens; --speculative-num-draft-tokens "
                             f"says {self.speculative_num_draft_tokens}")
        self.speculative_num_draft_tokens = steps + 1

    def _resolve_tree(self) -> None:
        """Tree drafting (EAGLE3, NEXTN): a beam of topk paths `steps` deep (default 3), of which
        --speculative-num-draft-tokens - 1 nodes (default all, to 32 tokens a row) are verified."""
        topk = self.speculative_eagle_topk
        steps = self.speculative_num_steps = self.speculative_num_steps or 3
        if steps < 1 or topk * steps > 32:
            raise ValueError(f"--speculative-eagle-topk {topk} x --speculative-num-steps {steps} "
                             "must be 1 to 32 (a tree row's tokens are an int32 mask's bits)")
        tokens = self.speculative_num_draft_tokens
        if tokens is None:
            tokens = self.speculative_num_draft_tokens = min(topk * steps + 1, 32)
        if not 2 <= tokens <= min(topk * steps + 1, 32):
            raise ValueError(f"--speculative-num-draft-tokens {tokens}: a tree of topk {topk} "
                             f"and {steps} steps verifies 2 to {min(topk * steps + 1, 32)} tokens "
                             "(its root and its likeliest nodes)")

    def _apply_speculative_config(self, text: str) -> None:
        try:
            config = json.loads(text)
        except ValueError as error:
            raise ValueError(f"--speculative-config is not JSON: {error}") from None
        if not isinstance(config, dict):
            raise ValueError("--speculative-config must be a JSON object")
        keys = {"method": "speculative_algorithm", "model": "speculative_draft_model_path",
                "num_speculative_tokens": "speculative_num_draft_tokens",
                "prompt_lookup_min": "speculative_ngram_min_match_window_size",
                "prompt_lookup_max": "speculative_ngram_max_match_window_size",
                "disable_by_batch_size": "speculative_disable_by_batch_size"}
        if unknown := sorted(set(config) - set(keys)):
            raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported "
                             f"(supported: {', '.join(keys)})")
        for key, value in config.items():
            if key == "method":
                value = {"draft_model": "STANDALONE", "deepseek_mtp": "NEXTN",
                         "qwen3_next_mtp": "NEXTN", "mtp": "NEXTN"}.get(value,
                                                                        str(value).upper())
            elif key == "model":
                value = str(value)
            elif not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"--speculative-config: {key} must be an integer; got {value!r}")
            elif key == "num_speculative_tokens":
                value += 1  # vLLM counts drafted tokens; SGLang's flag, the row's tokens
            setattr(self, keys[key], value)
