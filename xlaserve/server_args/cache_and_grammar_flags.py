"""The KV cache's flags (the prefix cache, its host tier, the entries' dtype, the cached-tokens
report) and structured outputs' (the grammar backend, JSON's whitespace): one area because
--help lists them interleaved, and its order is kept."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class CacheAndGrammarFlags:
    """The prefix cache and its host tier, the KV cache's dtype, structured outputs."""

    disable_radix_cache: bool = flag(
        False, "free the KV pages of finished requests instead of keeping them for later prompts "
               "that start with the same tokens (the prefix cache)")
    enable_hierarchical_cache: bool = flag(
        False, "SGLang's HiCache: prefix-cache pages evicted from the device pool move to a host "
               "memory tier instead of being dropped, and a prompt that matches them loads them "
               "back (a copy instead of a prefill)")
    hicache_ratio: float = flag(
        2.0, "the host tier's size as a multiple of the device KV pool's (with "
             "--enable-hierarchical-cache)")
    hicache_size: int = flag(
        0, "the host tier's size in GB, instead of --hicache-ratio (0: the ratio)")
    grammar_backend: str = flag(
        "llguidance", "structured outputs (json_schema, regex, ebnf, response_format): "
                      "llguidance, or none to refuse them with a 400; xgrammar and outlines "
                      "(SGLang's and vLLM's) are served by llguidance, which enforces the same "
                      "constraints",
        choices=["llguidance", "none"],
        value_aliases={"xgrammar": "llguidance", "outlines": "llguidance"})
    kv_cache_dtype: str = flag(
        "auto", "the KV cache's data type: auto (the model's --dtype), or fp8_e4m3 / fp8_e5m2: "
                "one byte an entry, twice the tokens of a bfloat16 cache in the same memory, each "
                "layer's K and V divided by the checkpoint's k_scale / v_scale (1.0 where it has "
                "none); fp8 is fp8_e4m3 (vLLM's name)",
        choices=["auto", "fp8_e5m2", "fp8_e4m3"], value_aliases={"fp8": "fp8_e4m3"})
    max_mamba_cache_size: Optional[int] = flag(
        None, "a hybrid linear-attention model's (Qwen3.5, Qwen3-Next) state slots in all, each "
              "one request's linear layers' state: the running requests', and the prefix "
              "cache's snapshots of cached prompts in the rest (SGLang's name; default twice "
              "--max-running-requests)")
    enable_cache_report: bool = flag(
        False, "accepted for SGLang's launch lines: usage.prompt_tokens_details.cached_tokens is "
               "always reported, as OpenAI does (SGLang reports it only with this flag)")
    constrained_json_whitespace_pattern: Optional[str] = flag(
        None, "regex of the whitespace allowed between JSON tokens in JSON-constrained output "
              "(default '[ ]?': one optional space, so a model cannot pad with whitespace until "
              "max_tokens; '[\\n\\t ]*' allows any)")

    def check_mamba_cache(self) -> None:
        """--max-mamba-cache-size's range (start-up checks it holds the running requests)."""
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < 1:
            raise ValueError("--max-mamba-cache-size must be at least 1")

    def check_host_tier(self) -> None:
        """--enable-hierarchical-cache's size, as a ratio of the device pool or in GB."""
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError("--hicache-ratio must be positive and --hicache-size 0 or more")
