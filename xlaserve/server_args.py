"""ServerArgs: every command-line flag in one dataclass, with SGLang's flag names.

The argparse parser is built from the dataclass fields (name -> `--name-with-dashes`, default,
help from the field metadata), so a flag is declared exactly once. A flag's metadata may also
name an environment variable read when the flag is not given (`env`), and mark it `secret`: shown
as "***" wherever the arguments are logged or served (`redacted`), or `path`: served by its last
component only (`served`), since a path on the server's disk is nothing a client needs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from typing import Optional

from xlaserve.lora_flags import lora_paths_of, resolve_lora
from xlaserve.speculative_flags import resolve_speculative

# The rest of a field's metadata goes to argparse. "aliases": more option strings (SGLang's and
# vLLM's names for the flag); "value_aliases": their names for a value, turned into ours.
_OWN_METADATA = ("help", "env", "secret", "path", "aliases", "value_aliases")
logger = logging.getLogger("xlaserve")


def public_name(value: str | None) -> str | None:
    """What a client may see of `value`: a file or directory on this machine (an absolute path,
    ~/..., or a relative path that exists) by its own name, never the folders above it; anything
    else (a hub id such as Qwen/Qwen2.5-0.5B-Instruct, a built-in template name, Jinja text) as
    given. None stays None."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if not (os.path.isabs(path) or os.path.exists(path)):
        return value
    return os.path.basename(os.path.abspath(path))  # abspath: no trailing "/", "." named


_RERANKER = {"architectures", "classifier_from_token", "is_original_qwen3_reranker"}


def hf_overrides(args) -> dict:
    """--hf-overrides, checked: a decoder reranker's keys (_RERANKER) and `is_causal` (a bool);
    {} without the flag. What else the overrides could say is refused in one line."""
    if args.hf_overrides is None:
        return {}
    try:
        overrides = json.loads(args.hf_overrides)
    except json.JSONDecodeError as error:
        raise ValueError(f"--hf-overrides is not JSON: {error}") from None
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


def _flag(default, help: str, **argparse_kwargs):
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclasses.dataclass
class ServerArgs:
    model_path: Optional[str] = _flag(
        None, "Hugging Face directory, hub id, .gguf file or xlaserve checkpoint; "
              "default: the embedded SmolLM2-135M-Instruct", path=True)
    tokenizer_path: Optional[str] = _flag(None, "tokenizer directory, if not the model's",
                                          path=True)
    revision: Optional[str] = _flag(
        None, "the branch, tag or commit of a Hugging Face hub --model-path (default: main)")
    trust_remote_code: bool = _flag(
        False, "let transformers run Python code shipped with the checkpoint for its config and "
               "tokenizer classes (downloaded with a hub model); the architecture must still be "
               "one xlaserve implements")
    load_format: str = _flag(
        "auto", 'the format of the model weights to load: "auto" reads them from --model-path '
                '(safetensors, GGUF or an xlaserve checkpoint); "dummy" initializes them with random '
                "values (seeded by --random-seed), mainly for profiling: --model-path then needs "
                "only a config.json (the file, or a directory holding it)",
        choices=["auto", "dummy"])
    dtype: str = _flag("auto", "weights and activations: auto (bfloat16 on TPU/GPU, float32 on CPU), "
                               "float32, bfloat16, float16",
                       choices=["auto", "float32", "bfloat16", "float16"])
    quantization: Optional[str] = _flag(
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
    served_model_name: Optional[str] = _flag(
        None, "model name in the API, /v1/models' id (default: a local --model-path's directory "
              "or file name, a hub id as given, SmolLM2-135M-Instruct for the embedded model). "
              "Requests may also name the model 'default', or --model-path exactly as given "
              "(as vLLM's and SGLang's clients do)")
    chat_template: Optional[str] = _flag(
        None, "chat template: a Jinja file, Jinja text, or a built-in name (chatml, "
              "llama-3-instruct, qwen3-reranker); default: the tokenizer's. A decoder reranker's "
              "(--hf-overrides): its prompt, from messages [query, document] and `instruct` "
              "(SGLang's qwen3_reranker.jinja; qwen3-reranker: the model card's); without one, "
              "the query's tokens then the document's, as vLLM",
        path=True)
    hf_overrides: Optional[str] = _flag(
        None, "vLLM's config overrides, as JSON; supported: a decoder reranker scored by two "
              "tokens' logits, e.g. Qwen3-Reranker: {\"architectures\": "
              "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", "
              "\"yes\"], \"is_original_qwen3_reranker\": true} (the server then scores pairs: "
              "/v1/rerank, /score); and an embedding decoder's attention, {\"is_causal\": false} "
              "(every token sees its whole input: gte-Qwen2-7B-instruct) or true (as transformers' "
              "class, for a backbone whose config names code of its own: gte-Qwen2-1.5B-instruct)")
    reasoning_parser: Optional[str] = _flag(
        None, "split reasoning from the answer for thinking models (vLLM's names: deepseek_r1 is "
              "deepseek-r1, openai_gptoss gpt-oss)",
        choices=["qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "kimi", "kimi_k2",
                 "gpt-oss"],
        value_aliases={"deepseek_r1": "deepseek-r1", "openai_gptoss": "gpt-oss"})
    tool_call_parser: Optional[str] = _flag(
        None, "parse tool calls out of the model's output (tool_choice auto) in this model "
              "family's format: qwen25 (<tool_call> JSON, Qwen2.5/Qwen3 and Hermes-style), llama3 "
              "(<|python_tag|> or bare JSON), mistral ([TOOL_CALLS]), deepseekv3, pythonic "
              "([f(a=1)]), kimi_k2 (<|tool_call_begin|>functions.NAME:i, Kimi K2), gpt-oss "
              "(Harmony messages to functions.NAME; with --reasoning-parser "
              "gpt-oss); forced tool_choice (required or a named function) needs none; "
              "vLLM's names: hermes is qwen25, llama3_json llama3, deepseek_v3 deepseekv3, "
              "deepseek_v31 deepseekv31, openai gpt-oss",
        choices=["qwen25", "qwen", "llama3", "mistral", "deepseekv3", "deepseekv31", "kimi_k2",
                 "pythonic", "gpt-oss"],
        value_aliases={"hermes": "qwen25", "llama3_json": "llama3", "deepseek_v3": "deepseekv3",
                       "deepseek_v31": "deepseekv31", "openai": "gpt-oss"})
    enable_auto_tool_choice: bool = _flag(
        False, "accepted for vLLM's launch lines: tool_choice auto needs only --tool-call-parser "
               "here (vLLM refuses it without this flag)")
    skip_tokenizer_init: bool = _flag(False, "do not load a tokenizer (token ids in and out)")
    is_embedding: bool = _flag(
        False, "serve the model's embeddings (/v1/embeddings, Engine.encode), pooled as its "
               "sentence-transformers files (modules.json, the Pooling module's config) say; the "
               "server then generates no text. Same as --runner pooling")
    runner: str = _flag(
        "auto", "what the server runs the model for: generate (text), pooling (embeddings, as "
                "--is-embedding), or auto: pooling where the checkpoint has sentence-transformers' "
                "modules.json, else generate. vLLM's --task embed is --runner pooling",
        choices=["auto", "generate", "pooling"], aliases=("--task",),
        value_aliases={"embed": "pooling", "embedding": "pooling"})
    # Vision-language models (Qwen2-VL, Qwen2.5-VL: images in chat messages; media_flags.py).
    mm_processor_kwargs: Optional[str] = _flag(
        None, "the image processor's min_pixels and max_pixels, as JSON (vLLM's flag), e.g. "
              "{\"max_pixels\": 1003520}: images are resized to fit; the vision tower is "
              "precompiled up to max_pixels (default: the checkpoint's, at most 1280*28*28)")
    limit_mm_per_prompt: Optional[str] = _flag(
        None, "images a request may carry, as vLLM's JSON {\"image\": N} (default 16)")
    max_image_bytes: int = _flag(
        20 * 2**20, "the largest image a request may send (a data: URL's decoded bytes, or a "
                    "fetched URL's body)")
    disable_image_url_fetch: bool = _flag(
        False, "refuse http(s) image URLs (only data: URLs, and files under "
               "--allowed-local-media-path); fetched URLs (and up to 5 redirects) must resolve "
               "to public addresses either way")
    image_fetch_timeout: float = _flag(5.0, "seconds to fetch one image URL")
    allowed_local_media_path: Optional[str] = _flag(
        None, "a directory whose files requests may name as images (file:// URLs; vLLM's "
              "flag); none by default", path=True)
    attention_backend: str = _flag("auto", "ragged paged attention implementation",
                                   choices=["auto", "reference", "cpu", "pallas"])
    matmul_backend: str = _flag(
        "auto", "matmuls: auto (the native GEMM over packed weights on a single CPU device, XLA's "
                "dots elsewhere), native, xla", choices=["auto", "native", "xla"])
    quantized_activations: str = _flag(
        "q8", "weights kept quantized on the CPU (a GGUF's blocks, --quantization int8's rows): "
              "q8 (default) quantizes each matmul's input per block of 32 (256 for K-quants) to "
              "8 bits and multiplies integers, as llama.cpp does (its numerics; W8A8 for int8 "
              "where K is a multiple of 32); float32 multiplies the exact float32 input by the "
              "exactly decoded weights (slower; logits closer to the dequantized model's)",
        choices=["q8", "float32"])
    mla_expanded_prefill_tokens: int = _flag(
        0, "multi-head latent attention models (DeepSeek-V2/V3, Kimi K2): steps of at least this "
           "many tokens take the expanded form, new tokens attended with per-head keys and "
           "values, the cached prefix in the latent space, merged by log-sum-exp (SGLang's and "
           "vLLM's form for prefills); 0 (default): the absorbed form always (on CPU the "
           "native absorbed kernel was faster below ~1000-token prompts; TPU/GPU untimed)")
    page_size: Optional[int] = _flag(
        None, "tokens per KV cache page (default 16; on TPU the smallest power of two from 16 "
              "whose page table fits the attention kernel's scalar memory)")
    tp_size: int = _flag(1, "tensor parallel size: devices that split each layer's heads (across "
                            "every process's devices with --nnodes)",
                         aliases=("--tensor-parallel-size",))
    ep_size: int = _flag(
        1, "expert parallel size: a mixture-of-experts layer's experts are split into this many "
           "groups over the --tp-size devices, which it must divide (attention stays split over "
           "all of them); within a group, each expert's width is split over tp/ep devices",
        aliases=("--expert-parallel-size",))
    dp_size: int = _flag(
        1, "data parallel size: replicas of the model on disjoint slices of --tp-size devices, "
           "each with its own scheduler and KV cache, requests spread by --load-balance-method",
        aliases=("--data-parallel-size",))
    load_balance_method: str = _flag(
        "round_robin", "how --dp-size replicas share requests: round_robin, or shortest_queue "
                       "(the replica with the fewest running + waiting requests)",
        choices=["round_robin", "shortest_queue"])
    nnodes: int = _flag(1, "processes (hosts) the model spans; each runs this same command with "
                           "its --node-rank; rank 0 serves HTTP, the others follow its steps")
    node_rank: int = _flag(0, "this process's rank among --nnodes (0: the leader)")
    dist_init_addr: Optional[str] = _flag(
        None, "HOST:PORT of rank 0 for jax.distributed's coordinator (with --nnodes > 1); the "
              "leader's step channel listens on PORT + 1")
    watchdog_timeout: float = _flag(
        300.0, "seconds the engine loop may spend in one step before the server declares it hung "
               "and answers 503 (a hung device, or a multi-host peer that stopped responding); "
               "0 = never")
    debug_step_hash_interval: int = _flag(
        0, "debug (--nnodes > 1, set on rank 0): every N-th step each follower hashes the tokens "
           "and logprobs it sampled and the leader compares them with its own; a mismatch stops "
           "the group (503s naming the step and rank). Costs followers a device sync per checked "
           "step; 0 = off")
    compilation_cache_dir: Optional[str] = _flag(
        None, "JAX persistent compilation cache, and in its `executables` folder the serving "
              "steps compiled (default: $XLASERVE_CACHE_DIR/xla, else ~/.cache/xlaserve/xla)",
        path=True)
    disable_executable_cache: bool = _flag(
        False, "trace and lower every serving step at start-up (JAX's persistent cache still "
               "skips the compiles) instead of loading the compiled steps a previous start "
               "stored; XLASERVE_EXECUTABLE_CACHE=0 does the same")
    conversion_cache_dir: Optional[str] = _flag(
        None, "where converted models (a GGUF file's dequantized weights, config and tokenizer) "
              "are kept so later starts skip the conversion (default: "
              "$XLASERVE_CONVERSION_CACHE_DIR, else $XLASERVE_CACHE_DIR/converted, else "
              "$XDG_CACHE_HOME/xlaserve/converted, else ~/.cache/xlaserve/converted)",
        path=True)
    disable_conversion_cache: bool = _flag(
        False, "convert a GGUF model on every start instead of loading it from (and writing it "
               "to) the conversion cache")
    context_length: Optional[int] = _flag(None, "longest prompt + output (default: the model's)",
                                          aliases=("--max-model-len",))
    max_running_requests: Optional[int] = _flag(
        None, "requests decoded together at most (default 64 on CPU, 256 on TPU/GPU, 512 on a "
              "GPU whose KV pool holds 2048 tokens for each: the largest sequence bucket of the "
              "compiled steps)", aliases=("--max-num-seqs",))
    max_total_tokens: Optional[int] = _flag(
        None, "KV cache size in tokens (default: from --mem-fraction-static)")
    mem_fraction_static: Optional[float] = _flag(
        None, "TPU/GPU: fraction of the memory XLA may allocate that holds the weights and the "
              "KV cache, the rest left to the steps' temporaries (default 0.9; on a GPU XLA may "
              "take 0.95 of the device unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise). "
              "CPU: fraction of free host RAM for the KV cache (default 0.1: the rest of the "
              "machine shares it)")
    chunked_prefill_size: Optional[int] = _flag(
        None, "longest prompt piece per step; <= 0 disables chunking (default 256 on CPU; on "
              "TPU/GPU 8192, or 2048 on a device of under 35 GB, as SGLang)")
    max_prefill_tokens: Optional[int] = _flag(
        None, "new prompt tokens per step at most (default 512 on CPU, the prompt piece's size "
              "on TPU/GPU)")
    disable_precompile: bool = _flag(False, "compile step shapes on first use instead of at start")
    precompile_threads: int = _flag(
        1, "step programs compiled at once at start (default 1: on a 2-core CPU two at once took "
           "1.36x as long)")
    precompile_token_paddings: Optional[str] = _flag(
        None, "comma-separated token-count buckets (default: powers of two)")
    precompile_bs_paddings: Optional[str] = _flag(
        None, "comma-separated sequence-count buckets (default: powers of two)")
    disable_overlap_schedule: bool = _flag(
        False, "wait for each step before handing out its tokens (default: detokenize and hand "
               "out a step's tokens while the next step computes)")
    # --- LoRA adapters (runtime/engine/lora_adapters.py) ---
    enable_lora: bool = _flag(
        False, "serve LoRA adapters: requests pick one with lora_path or model BASE:NAME (or "
               "NAME); implied by --lora-paths")
    lora_paths: Optional[list[str]] = _flag(
        None, "adapters loaded at start: NAME=PATH (a PEFT adapter directory or hub id), a bare "
              "PATH (named by its last folder; a hub id by itself), or JSON {\"lora_name\": ..., \"lora_path\": ...}",
        nargs="*", aliases=("--lora-modules",))
    max_loras_per_batch: int = _flag(
        8, "adapter slots on the device: the most adapters loaded (and in one batch) at once",
        aliases=("--max-loras",))
    max_lora_rank: Optional[int] = _flag(
        None, "every adapter's rank padded to this; a larger one is refused (default: the "
              "largest of --lora-paths, else 16)")
    lora_target_modules: Optional[list[str]] = _flag(
        None, "modules adapters may target, of q_proj k_proj v_proj o_proj gate_proj up_proj "
              "down_proj, or all (default: those --lora-paths target, else all)", nargs="*")
    # --- speculative decoding (runtime/scheduler/speculation.py) ---
    speculative_algorithm: Optional[str] = _flag(
        None, "speculative decoding: NGRAM drafts each request's next tokens from its own prompt "
              "and output (no draft model), STANDALONE with a small draft model of the same "
              "tokenizer (--speculative-draft-model-path), EAGLE3 (or EAGLE) with an EAGLE-3 "
              "head fed the model's hidden states (--speculative-draft-model-path), NEXTN with "
              "a DeepSeek-V3/R1 checkpoint's own multi-token-prediction layer; the model "
              "verifies the drafts in one step; greedy output is unchanged and sampled output "
              "keeps the model's distribution",
        choices=["NGRAM", "EAGLE", "EAGLE3", "NEXTN", "STANDALONE"],
        value_aliases={"ngram": "NGRAM"})
    speculative_draft_model_path: Optional[str] = _flag(
        None, "STANDALONE: the draft model (a directory, hub id or .gguf file, as "
              "--model-path), loaded with the model's --dtype and --quantization; its "
              "vocabulary must be the model's. EAGLE3: the head's directory or hub id "
              "(config.json and safetensors, as SGLang loads)", path=True)
    speculative_num_steps: Optional[int] = _flag(
        None, "EAGLE3 / NEXTN: draft steps per verified row, SGLang's (a chain: "
              "--speculative-num-draft-tokens is this plus one; a tree: its depth, default 3)")
    speculative_eagle_topk: Optional[int] = _flag(
        None, "EAGLE3 / NEXTN: drafts kept per step, SGLang's; 1: a chain; more: a "
              "tree, the likeliest --speculative-num-draft-tokens - 1 nodes of a beam of this "
              "many paths, verified in one row (topk x steps <= 32)")
    speculative_num_draft_tokens: Optional[int] = _flag(
        None, "tokens per verified row, the last accepted token included, as SGLang's: a row "
              "checks this many less one drafted tokens (default 5)")
    speculative_ngram_min_match_window_size: int = _flag(
        1, "NGRAM: the shortest run of a request's last tokens looked up in its earlier tokens")
    speculative_ngram_max_match_window_size: int = _flag(
        12, "NGRAM: the longest such run (the longest match found is drafted from)")
    speculative_disable_by_batch_size: Optional[int] = _flag(
        None, "decode without speculation while more than this many requests run (vLLM's "
              "disable_by_batch_size; default 32): where the batch already fills the device, a "
              "verified row costs more than it gains (measured, 2-core CPU: copying text, 1.9x "
              "faster at 32 running, 0.57x at 64; on an H200 a 5-token row cost 1.75x a decode "
              "step at 32 rows)")
    speculative_config: Optional[str] = _flag(
        None, "vLLM's form, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 12, "
              "\"disable_by_batch_size\": 16}; sets the flags above")
    disable_radix_cache: bool = _flag(
        False, "free the KV pages of finished requests instead of keeping them for later prompts "
               "that start with the same tokens (the prefix cache)")
    enable_hierarchical_cache: bool = _flag(
        False, "SGLang's HiCache: prefix-cache pages evicted from the device pool move to a host "
               "memory tier instead of being dropped, and a prompt that matches them loads them "
               "back (a copy instead of a prefill)")
    hicache_ratio: float = _flag(
        2.0, "the host tier's size as a multiple of the device KV pool's (with "
             "--enable-hierarchical-cache)")
    hicache_size: int = _flag(
        0, "the host tier's size in GB, instead of --hicache-ratio (0: the ratio)")
    grammar_backend: str = _flag(
        "llguidance", "structured outputs (json_schema, regex, ebnf, response_format): "
                      "llguidance, or none to refuse them with a 400; xgrammar and outlines "
                      "(SGLang's and vLLM's) are served by llguidance, which enforces the same "
                      "constraints",
        choices=["llguidance", "none"],
        value_aliases={"xgrammar": "llguidance", "outlines": "llguidance"})
    kv_cache_dtype: str = _flag(
        "auto", "the KV cache's data type: auto (the model's --dtype), or fp8_e4m3 / fp8_e5m2: "
                "one byte an entry, twice the tokens of a bfloat16 cache in the same memory, each "
                "layer's K and V divided by the checkpoint's k_scale / v_scale (1.0 where it has "
                "none); fp8 is fp8_e4m3 (vLLM's name)",
        choices=["auto", "fp8_e5m2", "fp8_e4m3"], value_aliases={"fp8": "fp8_e4m3"})
    enable_cache_report: bool = _flag(
        False, "accepted for SGLang's launch lines: usage.prompt_tokens_details.cached_tokens is "
               "always reported, as OpenAI does (SGLang reports it only with this flag)")
    constrained_json_whitespace_pattern: Optional[str] = _flag(
        None, "regex of the whitespace allowed between JSON tokens in JSON-constrained output "
              "(default '[ ]?': one optional space, so a model cannot pad with whitespace until "
              "max_tokens; '[\\n\\t ]*' allows any)")
    # --- what one request may ask (runtime/sampling/params.RequestLimits; 400 naming the field) ---
    max_n: int = _flag(128, "most choices (n) per prompt of one request")
    max_sequences_per_request: int = _flag(
        256, "most sequences one request generates: prompts x n (completions and /generate take "
             "lists of prompts)")
    max_stop_sequences: int = _flag(16, "most stop strings per request (OpenAI allows 4)")
    max_stop_sequence_length: int = _flag(256, "longest stop string, in characters")
    max_constraint_size: int = _flag(
        256 * 1024, "longest JSON schema, regex or EBNF grammar (structured outputs, and each "
                    "tool's parameters schema), in characters")
    grammar_compile_timeout: float = _flag(
        10.0, "seconds a request's grammar (structured outputs, strict tools) may take to compile "
              "before the request is refused with a 400")
    max_tools: int = _flag(128, "most tools per chat request (OpenAI's limit)")
    max_prompt_logprob_entries: int = _flag(
        1 << 20, "most prompt logprob entries one request may ask for (completions' echo with "
                 "logprobs, /generate's logprob_start_len 0): prompt tokens x (1 + top "
                 "logprobs), summed over its sequences")
    max_queued_requests: int = _flag(
        4096, "most requests waiting for a running slot, all clients together; beyond it a "
              "request is refused with 503 and Retry-After (never an unbounded queue)")
    enable_priority_scheduling: bool = _flag(
        False, "honour a request's `priority` (larger runs first); without it a request that "
               "sets one is refused with a 400")
    strict_request_fields: bool = _flag(
        False, "refuse a request with a field this server does not know (a 400 naming it). "
               "Default: such fields are ignored, as OpenAI-compatible servers do; each distinct "
               "name is logged once as a warning, and the answer lists the request's ignored "
               "fields in its X-Ignored-Fields header")
    random_seed: Optional[int] = _flag(
        None, "seed for requests that do not give one, and of --load-format dummy's weights (0 if unset)")
    log_level: str = _flag("info", "logging level", choices=["debug", "info", "warning", "error"])
    # --- the HTTP server ---
    host: str = _flag("127.0.0.1", "address to listen on")
    port: int = _flag(30000, "port to listen on")
    api_key: Optional[str] = _flag(
        None, "require 'Authorization: Bearer <key>' on every route but /health and /metrics; "
              "default: $XLASERVE_API_KEY. Prefer the variable: a key on the command line is "
              "visible to every user of the machine (ps, /proc)",
        env="XLASERVE_API_KEY", secret=True)
    allowed_origins: Optional[str] = _flag(
        None, "comma-separated browser origins (scheme://host[:port]) allowed to call the server, "
              "answered with CORS headers; * allows any. A request from any other Origin than "
              "the server's own is refused (403)")
    max_payload_size: int = _flag(32 * 1024 * 1024, "largest request body in bytes (413 above)")
    enable_metrics: bool = _flag(False, "serve Prometheus metrics at /metrics")
    metrics_name_style: str = _flag(
        "xlaserve", "the metrics' names: xlaserve (SGLang's names, xlaserve: prefix), sglang "
                    "(SGLang's exactly: sglang:num_running_reqs...) or vllm (vLLM's: "
                    "vllm:num_requests_running, vllm:kv_cache_usage_perc...), for their dashboards",
        choices=["xlaserve", "sglang", "vllm"])
    bucket_time_to_first_token: Optional[list[float]] = _flag(
        None, "time-to-first-token histogram buckets in seconds (default: 0.005 to 160)",
        nargs="+")
    bucket_inter_token_latency: Optional[list[float]] = _flag(
        None, "inter-token latency histogram buckets in seconds (default: as above)", nargs="+")
    bucket_e2e_request_latency: Optional[list[float]] = _flag(
        None, "request latency histogram buckets in seconds (default: as above)", nargs="+")
    log_requests: bool = _flag(False, "log every HTTP request")
    stream_interval: int = _flag(1, "tokens per streamed chunk")
    skip_server_warmup: bool = _flag(False, "do not run a warm-up generation before ready")
    graceful_shutdown_timeout: float = _flag(
        30.0, "seconds that running requests and batch lines may take to finish after SIGTERM or "
              "SIGINT (new ones get 503 meanwhile); the rest are then aborted with an error and "
              "the server exits (status 0; a second signal ends the wait at once)")
    # --- files and batches ---
    file_storage_path: str = _flag(
        "xlaserve_storage", "folder of uploaded files, batch results and their metadata "
                            "(SQLite); unfinished batches resume from it at start", path=True)
    max_file_size: int = _flag(200 * 1024 * 1024, "largest file upload in bytes (413 above)")
    batch_max_lines: int = _flag(50000, "most requests in one batch input file")
    batch_concurrency: Optional[int] = _flag(
        None, "batch requests in flight at once, all batches together (default: "
              "--max-running-requests less an eighth, left to interactive requests)")

    def __post_init__(self):
        """SGLang's and vLLM's value names become ours; what cannot run stops here."""
        for field in dataclasses.fields(self):
            aliases = field.metadata.get("value_aliases", {})
            value = getattr(self, field.name)
            if aliases and value in aliases:
                logger.info("--%s %s: served as %s", field.name.replace("_", "-"), value,
                            aliases[value])
                setattr(self, field.name, aliases[value])
        if self.max_tools < 0:
            raise ValueError(f"--max-tools must be 0 or more; got {self.max_tools}")
        if self.precompile_threads < 1:
            raise ValueError(f"--precompile-threads must be 1 or more; got "
                             f"{self.precompile_threads}")
        if reranker_tokens(self) is not None:  # a decoder reranker: a scoring server
            if self.runner == "generate":
                raise ValueError("--hf-overrides classifier_from_token with --runner generate: "
                                 "a reranker scores, it does not generate")
            self.runner = "pooling"
        if self.is_embedding:
            if self.runner == "generate":
                raise ValueError("--is-embedding with --runner generate: give one")
            self.runner = "pooling"
        resolve_speculative(self)
        resolve_lora(self)
        if self.runner == "pooling":
            self.refuse_for_embeddings()
        if self.enable_hierarchical_cache:
            self.refuse_for_hierarchical_cache()
        if self.mla_expanded_prefill_tokens < 0:
            raise ValueError("--mla-expanded-prefill-tokens must be 0 (never) or a token count; "
                             f"got {self.mla_expanded_prefill_tokens}")

    def refuse_for_embeddings(self) -> None:
        """What an embedding server does not run stops its start (ValueError naming the flag)."""
        for flag, given in (("--speculative-algorithm", self.speculative_algorithm),
                            ("--enable-lora", self.enable_lora),
                            ("--nnodes > 1", self.nnodes > 1),
                            ("--kv-cache-dtype " + self.kv_cache_dtype,
                             self.kv_cache_dtype != "auto")):
            if given:
                raise ValueError(f"{flag} with an embedding model (--is-embedding / --runner "
                                 "pooling): not supported")

    def refuse_for_hierarchical_cache(self) -> None:
        """What the host tier of the prefix cache does not run with stops start-up."""
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError("--hicache-ratio must be positive and --hicache-size 0 or more")
        for flag, given in (("--disable-radix-cache", self.disable_radix_cache),
                            ("--speculative-algorithm", self.speculative_algorithm),
                            ("--nnodes > 1", self.nnodes > 1),
                            ("--is-embedding / --runner pooling", self.runner == "pooling")):
            if given:
                raise ValueError(f"--enable-hierarchical-cache with {flag}: not supported")

    def refuse_for_vision(self) -> None:
        """What a vision-language server does not run stops its start (ValueError naming the
        flag)."""
        for flag, given in (("--speculative-algorithm", self.speculative_algorithm),
                            ("--enable-lora", self.enable_lora),
                            ("--nnodes > 1", self.nnodes > 1),
                            ("--quantization", self.quantization)):
            if given:
                raise ValueError(f"{flag} with a vision-language model: not supported")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for field in dataclasses.fields(cls):
            flag = "--" + field.name.replace("_", "-")
            names = (flag, *field.metadata.get("aliases", ()))
            extra = {k: v for k, v in field.metadata.items() if k not in _OWN_METADATA}
            if "choices" in extra:
                extra["choices"] = [*extra["choices"], *field.metadata.get("value_aliases", {})]
            if field.type in ("bool", bool):
                parser.add_argument(*names, dest=field.name, action="store_true",
                                    help=field.metadata["help"])
                continue
            # `from __future__ import annotations` makes types strings: "int", "Optional[float]"...
            type_name = str(field.type).removeprefix("Optional[").removesuffix("]")
            kind = {"int": int, "float": float, "list[float]": float}.get(type_name, str)
            parser.add_argument(*names, dest=field.name, type=kind, default=field.default,
                                help=field.metadata["help"], **extra)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        for field in dataclasses.fields(cls):
            variable = field.metadata.get("env")
            if variable and values[field.name] is None and os.environ.get(variable):
                values[field.name] = os.environ[variable]
        return cls(**values)

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


def configure_logging(log_level: str) -> None:
    """The root logger at `log_level`, and JAX's own loggers at WARNING at least: at INFO they
    printed a start-up line for every backend JAX probes and fails ("Unable to initialize backend
    'tpu' ... Failed to open libtpu.so" on a CPU or GPU machine with libtpu installed) and two
    "Resetting cache" lines per precompiled program (runtime/compile/executable_cache.py toggles JAX's
    cache around each compile). `--log-level debug` shows them."""
    level = getattr(logging, log_level.upper())
    logging.basicConfig(level=level, format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")
    logging.getLogger("jax").setLevel(max(level, logging.WARNING))
