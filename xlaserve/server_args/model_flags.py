"""The model's flags: which checkpoint, its tokenizer, how its weights are loaded and
quantized, the name it is served under, its chat template, and --hf-overrides, read here
(`hf_overrides`, `reranker_tokens`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag, json_flag


@dataclasses.dataclass
class ModelFlags:
    """The model, and how it is loaded."""

    model_path: Optional[str] = flag(
        None, "Hugging Face directory, hub id, .gguf file or xlaserve checkpoint; "
              "default: the embedded SmolLM2-135M-Instruct", path=True)
    tokenizer_path: Optional[str] = flag(None, "tokenizer directory, if not the model's",
                                         path=True)
    revision: Optional[str] = flag(
        None, "the branch, tag or commit of a Hugging Face hub --model-path (default: main)")
    trust_remote_code: bool = flag(
        False, "let transformers run Python code shipped with the checkpoint for its config and "
               "tokenizer classes (downloaded with a hub model); the architecture must still be "
               "one xlaserve implements")
    load_format: str = flag(
        "auto", 'the format of the model weights to load: "auto" reads them from --model-path '
                '(safetensors, GGUF or an xlaserve checkpoint); "dummy" initializes them with random '
                "values (seeded by --random-seed), mainly for profiling: --model-path then needs "
                "only a config.json (the file, or a directory holding it)",
        choices=["auto", "dummy"])
    dtype: str = flag("auto", "weights and activations: auto (bfloat16 on TPU/GPU, float32 on CPU), "
                              "float32, bfloat16, float16",
                      choices=["auto", "float32", "bfloat16", "float16"])
    quantization: Optional[str] = flag(
        None, "int8: the attention and MLP weights quantized at load to int8 with a float32 scale "
              "per output channel (symmetric, weight-only; half the bytes of bfloat16), from a "
              "float checkpoint; multiplied by XLA's dots on every platform (on CPU instead of "
              "the native GEMM); the embedding, LM head and experts stay in --dtype. "
              "fp8: the same weights as float8_e4m3fn with a float32 scale per output channel, "
              "activations quantized to FP8 per token at each step, FP8 x FP8 matmuls; NVIDIA "
              "GPUs of compute capability 8.9+ (H100) only. FP8 checkpoints need no flag: "
              "they stay FP8 where FP8 matmuls run and are dequantized at load elsewhere. "
              "mxfp4: a gpt-oss checkpoint's MXFP4 experts kept as stored, four bits a weight "
              "(a quarter of bfloat16's bytes: gpt-oss-120b on one 80 GB GPU), decoded inside "
              "the experts' kernel; NVIDIA GPUs, tensor parallel size 1 (expert parallelism "
              "allowed). Without it they are decoded to bfloat16 at load, which an H200 "
              "multiplied 2.1-2.7x faster (2026-11-27)",
        choices=["int8", "fp8", "mxfp4"])
    served_model_name: Optional[str] = flag(
        None, "model name in the API, /v1/models' id (default: a local --model-path's directory "
              "or file name, a hub id as given, SmolLM2-135M-Instruct for the embedded model). "
              "Requests may also name the model 'default', or --model-path exactly as given "
              "(as vLLM's and SGLang's clients do)")
    chat_template: Optional[str] = flag(
        None, "chat template: a Jinja file, Jinja text, or a built-in name (chatml, "
              "llama-3-instruct, qwen3-reranker); default: the tokenizer's. A decoder reranker's "
              "(--hf-overrides): its prompt, from messages [query, document] and `instruct` "
              "(SGLang's qwen3_reranker.jinja; qwen3-reranker: the model card's); without one, "
              "the query's tokens then the document's, as vLLM",
        path=True)
    hf_overrides: Optional[str] = flag(
        None, "vLLM's config overrides, as JSON; supported: a decoder reranker scored by two "
              "tokens' logits, e.g. Qwen3-Reranker: {\"architectures\": "
              "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", "
              "\"yes\"], \"is_original_qwen3_reranker\": true} (the server then scores pairs: "
              "/v1/rerank, /score); and an embedding decoder's attention, {\"is_causal\": false} "
              "(every token sees its whole input: gte-Qwen2-7B-instruct) or true (as transformers' "
              "class, for a backbone whose config names code of its own: gte-Qwen2-1.5B-instruct)")
    weight_version: str = flag(
        "default", "the served weights' version, reported in /get_model_info, "
                   "/get_weight_version and each response's meta_info; an update's "
                   "weight_version replaces it (RL rollouts: docs/server.md)")
    enable_weights_cpu_backup: bool = flag(
        False, "/release_memory_occupation keeps a copy of the weights in host memory, from "
               "which /resume_memory_occupation restores them; without it they come back "
               "empty and generation waits for an update of the weights")


_RERANKER = {"architectures", "classifier_from_token", "is_original_qwen3_reranker"}


def hf_overrides(args) -> dict:
    """--hf-overrides, checked: a decoder reranker's keys (_RERANKER) and `is_causal` (a bool);
    {} without the flag. What else the overrides could say is refused in one line."""
    if args.hf_overrides is None:
        return {}
    overrides = json_flag(args.hf_overrides, "--hf-overrides")
    if not isinstance(overrides, dict) or set(overrides) - _RERANKER - {"is_causal"}:
        raise ValueError(f"--hf-overrides {args.hf_overrides[:120]}: only is_causal and a decoder "
                         f"reranker's {sorted(_RERANKER)} are supported")
    if not isinstance(overrides.get("is_causal", True), bool):
        raise ValueError("--hf-overrides is_causal: true or false")
    return overrides


def reranker_tokens(args) -> list[str] | None:
    """--hf-overrides' classifier_from_token ([no, yes]: a decoder reranker), checked; None
    without one."""
    overrides = hf_overrides(args)
    if not set(overrides) & _RERANKER:
        return None
    architectures = overrides.get("architectures") or [""]
    tokens = overrides.get("classifier_from_token")
    if (not str(architectures[0]).endswith("ForSequenceClassification") or not tokens
            or overrides.get("is_original_qwen3_reranker") is not True):
        raise ValueError("--hf-overrides: a decoder reranker needs architectures "
                         "[\"<Model>ForSequenceClassification\"], classifier_from_token [no, yes] "
                         "and is_original_qwen3_reranker true (its LM head's rows score)")
    return list(tokens)
