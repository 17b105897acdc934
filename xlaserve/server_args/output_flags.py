"""The flags that say what the server makes of the model: text, its reasoning and tool calls
parsed out of it (--reasoning-parser, --tool-call-parser), token ids only
(--skip-tokenizer-init), embeddings and scores (--is-embedding, --runner, --pooler-config), or
the last layer's hidden states beside the text (--enable-return-hidden-states)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag, json_flag

_POOLING_TYPES = {"LAST": "last", "MEAN": "mean", "CLS": "cls"}  # vLLM's names -> ours


@dataclasses.dataclass
class OutputFlags:
    """What the server makes of the model's output."""

    reasoning_parser: Optional[str] = flag(
        None, "split reasoning from the answer for thinking models (vLLM's names: deepseek_r1 is "
              "deepseek-r1, openai_gptoss gpt-oss)",
        choices=["qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "kimi", "kimi_k2",
                 "gemma4", "gpt-oss"],
        value_aliases={"deepseek_r1": "deepseek-r1", "openai_gptoss": "gpt-oss"})
    tool_call_parser: Optional[str] = flag(
        None, "parse tool calls out of the model's output (tool_choice auto) in this model "
              "family's format: qwen25 (<tool_call> JSON, Qwen2.5/Qwen3 and Hermes-style), llama3 "
              "(<|python_tag|> or bare JSON), mistral ([TOOL_CALLS]), deepseekv3, pythonic "
              "([f(a=1)]; llama4 is the same, Llama 4 prompted for Python-style calls), "
              "llama4_json (Llama 4's own template: <|python_start|>...<|python_end|> then JSON "
              "calls), gemma4 (<|tool_call>call:NAME{...}<tool_call|>, Gemma 4), kimi_k2 "
              "(<|tool_call_begin|>functions.NAME:i, Kimi K2), gpt-oss "
              "(Harmony messages to functions.NAME; with --reasoning-parser "
              "gpt-oss); forced tool_choice (required or a named function) needs none; "
              "vLLM's names: hermes is qwen25, llama3_json llama3, llama4_pythonic pythonic, "
              "deepseek_v3 deepseekv3, deepseek_v31 deepseekv31, openai gpt-oss",
        choices=["qwen25", "qwen", "llama3", "mistral", "deepseekv3", "deepseekv31", "kimi_k2",
                 "pythonic", "llama4", "llama4_json", "gemma4", "gpt-oss"],
        value_aliases={"hermes": "qwen25", "llama3_json": "llama3", "llama4_pythonic": "pythonic",
                       "deepseek_v3": "deepseekv3", "deepseek_v31": "deepseekv31",
                       "openai": "gpt-oss"})
    enable_auto_tool_choice: bool = flag(
        False, "accepted for vLLM's launch lines: tool_choice auto needs only --tool-call-parser "
               "here (vLLM refuses it without this flag)")
    skip_tokenizer_init: bool = flag(False, "do not load a tokenizer (token ids in and out)")
    is_embedding: bool = flag(
        False, "serve the model's embeddings (/v1/embeddings, Engine.encode), pooled as its "
               "sentence-transformers files (modules.json, the Pooling module's config) say, or, "
               "for a decoder without them, its last token, normalized (as SGLang and vLLM); the "
               "server then generates no text. Same as --runner pooling")
    pooler_config: Optional[str] = flag(
        None, "how an embedding server pools, over what the checkpoint says (vLLM's): JSON "
              "{\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true | false}")
    runner: str = flag(
        "auto", "what the server runs the model for: generate (text), pooling (embeddings, as "
                "--is-embedding), or auto: pooling where the checkpoint pools (sentence-"
                "transformers' modules.json; a *ForSequenceClassification classifier, reranker "
                "or reward model), else generate. vLLM's --task embed is --runner pooling",
        choices=["auto", "generate", "pooling"], aliases=("--task",),
        value_aliases={"embed": "pooling", "embedding": "pooling"})
    enable_return_hidden_states: bool = flag(
        False, "let a request ask for the last layer's hidden states (after the final norm) of "
               "its prompt and of each token it generates (SGLang's return_hidden_states on "
               "/generate and Engine.generate); without it such a request is refused with a 400. "
               "Each step then also returns its rows' hidden states on the device, read only "
               "in steps where a request asked")
    max_hidden_state_values: int = flag(
        1 << 22, "most hidden-state values one response may carry (with "
                 "--enable-return-hidden-states): (prompt + max_new_tokens) tokens x the hidden "
                 "size, summed over its sequences, and over the events of a stream (each holds "
                 "every row so far); 1 << 22 is 1024 tokens of a 4096-wide model")


def pooler_config(args) -> dict:
    """--pooler-config as Pooling's fields ({"mode", "normalize"}, either or both), checked; {}
    without the flag. vLLM's other keys (softmax, dimensions, ...) are refused in one line."""
    if args.pooler_config is None:
        return {}
    config = json_flag(args.pooler_config, "--pooler-config")
    if not isinstance(config, dict) or not config or set(config) - {"pooling_type", "normalize"}:
        raise ValueError(f"--pooler-config {args.pooler_config[:120]}: only pooling_type and "
                         "normalize are supported")
    fields = {}
    if "pooling_type" in config:
        kind = config["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in _POOLING_TYPES:
            raise ValueError(f"--pooler-config pooling_type {str(kind)[:40]!r}: one of "
                             f"{', '.join(_POOLING_TYPES)}")
        fields["mode"] = _POOLING_TYPES[kind.upper()]
    if "normalize" in config:
        if not isinstance(config["normalize"], bool):
            raise ValueError("--pooler-config normalize: true or false")
        fields["normalize"] = config["normalize"]
    return fields
