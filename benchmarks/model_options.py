"""Which model a benchmark runs, and the token ids its random prompts are drawn from.

By default the embedded model (its GGUF tokenizer). With `--model-path`, any model xlaserve
loads, or with `--load-format dummy` a bare config such as benchmarks/configs/qwen2.5-0.5b: a
model without tokenizer files runs with `skip_tokenizer_init` and prompts of token ids drawn from
its config's vocabulary (less BOS and EOS).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any


@dataclasses.dataclass
class Vocabulary:
    allowed_ids: list[int]  # the ids random prompts are drawn from: no special tokens
    tokenizer: Any | None  # None: the model has no tokenizer (token ids in and out)
    stop_ids: set[int]  # end-of-text ids, which a benchmark bans to get every output token


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None,
                        help="the model xlaserve runs (default: the embedded SmolLM2-135M-Instruct); "
                             "with --load-format dummy, a config.json or a folder holding one, "
                             "e.g. benchmarks/configs/qwen2.5-0.5b")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="xlaserve's --load-format: dummy gives random weights (no checkpoint)")


def model_vocabulary(model_path: str | None, load_format: str = "auto") -> Vocabulary:
    from xlaserve.weights.loader import load_tokenizer, read_config

    config, tokenizer_source = read_config(model_path, load_format)
    stop_ids = set(config.eos_token_ids)
    if tokenizer_source is None:
        special = {config.bos_token_id, *stop_ids}
        return Vocabulary([t for t in range(config.vocab_size) if t not in special], None, stop_ids)
    tokenizer = load_tokenizer(tokenizer_source)
    special = set(tokenizer.all_special_ids)
    stop_ids |= {tokenizer.eos_token_id} - {None}
    return Vocabulary([t for t in range(len(tokenizer)) if t not in special], tokenizer, stop_ids)


def engine_model_args(args: argparse.Namespace, vocabulary: Vocabulary) -> dict:
    """The Engine / launch_server settings that pick the model."""
    return {"model_path": args.model_path, "load_format": args.load_format,
            "skip_tokenizer_init": vocabulary.tokenizer is None}


def first_layers_config(config: dict, num_layers: int) -> dict:
    """A config.json's dict cut to its first `num_layers` decoder layers (per-layer lists too:
    gpt-oss's `layer_types`, Nemotron-H's block pattern). Every layer of the benchmarked models has the same shapes, so the
    cut model's step has the whole one's per-layer work."""
    cut = {**config, "num_hidden_layers": num_layers}
    for per_layer in ("layer_types", "hybrid_override_pattern", "layers_block_type"):  # Nemotron-H's
        if per_layer in config:
            cut[per_layer] = config[per_layer][:num_layers]
    return cut
