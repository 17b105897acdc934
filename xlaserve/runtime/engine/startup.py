"""An EngineCore's start-up: what `build` makes from the server arguments, in this order.

1. the model (`load_model`, on this replica's devices), logged as "Load weight end.";
2. the KV pool's size (`--page-size` resolved for the platform, pages from --max-total-tokens
   or the free memory left after the weights) and the ModelRunner, which starts zeroing the
   pool on a thread and then packs the weights;
3. with --nnodes > 1, the Leader (runtime/distributed/leader.py `lead`): it waits for the followers,
   sends them the runner's configuration and puts its command sink on the runner, so the
   followers build theirs meanwhile and replay the precompile and every later call;
4. the serving buckets, the scheduler, the EOS ids and the grammar backend (host objects);
5. the precompile: each bucket's step loaded from the executable cache or compiled, and then
   the wait for the KV pool, whose zeroing has overlapped the packing and the precompile.

The pool is sized before the runner because the runner's programs are shaped by it, and the
precompile comes last because it needs the buckets and (multi-host) the sink. Each phase's
seconds go to `startup_timings`, for the server's "Start-up:" log line (launch_server.py).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import jax
import numpy as np
from flax import nnx

from xlaserve.runtime.distributed.leader import Leader, OneProcess, lead
from xlaserve.weights.loader import (LoadedModel, load_model, server_load_options,
                                     tensor_parallel_mesh)
from xlaserve.runtime.host import malloc_tuning
from xlaserve.runtime.executor.forward_batch import Buckets
from xlaserve.runtime.executor.buckets import serving_buckets, with_page_size
from xlaserve.runtime.compile.persistent_cache import enable_persistent_cache
from xlaserve.runtime.compile.executable_cache import ExecutableCache, enabled_by_environment
from xlaserve.runtime.sampling.grammar import GrammarBackend
from xlaserve.runtime.executor.kv_pool import bytes_per_token, num_pages_for
from xlaserve.runtime.executor.state_pool import state_bytes_per_slot
from xlaserve.runtime.executor.host_kv_pool import HostKvPool, HostTierCopies, host_tier_pages
from xlaserve.runtime.scheduler.page_allocator import PageAllocator
from xlaserve.runtime.scheduler.prefix_reuse import PrefixReuse
from xlaserve.runtime.scheduler.state_reuse import StatePrefixReuse
from xlaserve.model.fp8_kv_cache import resolve_kv_cache_dtype
from xlaserve.model.weight_types.quantized_rows import native_gemm_available
from xlaserve.runtime.executor.drafts.draft_head import DraftHead
from xlaserve.runtime.executor.drafts.draft_model import DraftModel
from xlaserve.weights.draft_head import load_server_draft_head
from xlaserve.runtime.executor.embedding_step import EmbeddingRunner
from xlaserve.runtime.executor.model_runner import ModelRunner
from xlaserve.runtime.engine.pooled_outputs import PooledSteps, pooling_of
from xlaserve.runtime.engine.steps import NO_HIDDEN_STATES, GenerationSteps, NoHiddenStates
from xlaserve.runtime.engine.hidden_states import HiddenStates
from xlaserve.runtime.engine.adapter_slots import AdapterSlots
from xlaserve.runtime.engine.lora_adapters import LoraAdapters, lora_setup
from xlaserve.runtime.engine.image_prompts import ImagePrompts, image_processor, max_patches
from xlaserve.runtime.engine.gemma3_images import gemma3_image_prompts
from xlaserve.runtime.engine.llama4_images import llama4_image_prompts
from xlaserve.runtime.engine.gemma4_images import gemma4_image_prompts
from xlaserve.runtime.executor.vision_encoder import VisionEncoder
from xlaserve.runtime.scheduler.scheduler import EveryRequest, NoSpeculation, Scheduler
from xlaserve.runtime.scheduler.speculation import SpeculativeConfig, Speculator
from xlaserve.server_args import (Mode, ServerArgs, images_per_request, platform_defaults,
                                  processor_kwargs, refuse_conflicts)
from xlaserve.weights.pooling import MODULES_FILE, Pooling
from xlaserve.weights.classifier_head import ClassifierHead

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineParts:
    """What an EngineCore serves with; each becomes the core's attribute of the same name."""

    args: ServerArgs  # with --page-size and the platform's defaults resolved
    loaded: LoadedModel
    tokenizer: object | None  # None with --skip-tokenizer-init
    context_length: int
    runner: ModelRunner
    buckets: Buckets
    scheduler: Scheduler
    eos_token_ids: set[int]
    grammar_backend: GrammarBackend | None  # structured outputs; off without a tokenizer or "none"
    startup_timings: dict[str, float]  # seconds per phase, in order
    thread_name: str  # the engine loop's: "xlaserve-engine", "-dpN" for a data parallel replica
    # --nnodes > 1: the Leader, whose followers replay the runner's device calls; else OneProcess
    group: Leader | OneProcess = dataclasses.field(default_factory=OneProcess)
    draft: DraftModel | None = None  # --speculative-algorithm STANDALONE: the draft model
    draft_head: DraftHead | None = None  # EAGLE3, NEXTN: the draft head's own steps
    lora_adapters: list | None = None  # --enable-lora: --lora-paths' adapters, read (else None)
    # --enable-lora: which adapter each slot holds, the scheduler's admission gate (else None)
    adapter_slots: AdapterSlots | None = None
    pooling: Pooling | None = None  # an embedding server's (--is-embedding); None: it generates
    # A reranker's, classifier's or reward model's (weights/classifier_head.py)
    classifier_head: ClassifierHead | None = None
    # A vision-language model's images -> prompts (image_prompts.py); None: text only.
    images: ImagePrompts | None = None
    # --enable-hierarchical-cache: the prefix cache's host tier in host memory; else None.
    host_kv: HostKvPool | None = None
    # --enable-return-hidden-states: the steps' hidden states for the requests that ask.
    hidden_states: HiddenStates | NoHiddenStates = NO_HIDDEN_STATES


@dataclasses.dataclass(frozen=True)
class Features:
    """What a server serves beyond plain generation, each None where it is off: the one record
    the single and the data parallel engines share (every replica's is the same) and the HTTP
    layer and the offline Engine read."""

    pooling: Pooling | None = None  # an embedding server's (--is-embedding)
    classifier_head: ClassifierHead | None = None  # a classifier's (weights/classifier_head.py)
    images: ImagePrompts | None = None  # a vision model's images -> prompts (image_prompts.py)
    lora: LoraAdapters | None = None  # --enable-lora: the adapters by name (lora_adapters.py)
    # --enable-return-hidden-states (hidden_states.py); off, a do-nothing one that refuses.
    hidden_states: HiddenStates | NoHiddenStates = NO_HIDDEN_STATES


def prefix_caching(args: ServerArgs, config, pooling: Pooling | None) -> bool:
    """Whether the scheduler reuses cached prefixes: not with --disable-radix-cache, nor for an
    encoder's or CLS / mean pooling's pages (pooled_outputs.py)."""
    return not args.disable_radix_cache and (
        pooling is None or (pooling.mode == "last" and not config.bidirectional))


def state_snapshots(args: ServerArgs, config) -> int:
    """A hybrid model's state slots for its prefix cache's snapshots (scheduler/state_reuse.py):
    --max-mamba-cache-size's slots past the running requests' (default as many); none without
    linear layers or prefix caching."""
    if not config.state_layers or args.disable_radix_cache:
        return 0
    running = args.max_running_requests
    total = args.max_mamba_cache_size or 2 * running
    if total < running:
        raise ValueError(f"--max-mamba-cache-size {total}: the state slots must hold the "
                         f"--max-running-requests {running} running requests' states")
    return total - running


def build(server_args: ServerArgs, dp_rank: int = 0, share_with=None) -> EngineParts:
    """The parts of replica `dp_rank` (EngineCore's arguments). `share_with`: an EngineCore whose
    tokenizer and grammar backend these parts use."""
    args = server_args
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    malloc_tuning.limit_arenas()  # before XLA's threads allocate
    compilation_cache_dir = enable_persistent_cache(args.compilation_cache_dir)
    options = server_load_options(args)
    embeds = not options["lm_head"]  # an embedding server (loader.serves_embeddings)
    if embeds and args.runner == "auto":
        logger.info("Serving embeddings or scores (--runner auto): the checkpoint is a "
                    "sentence-transformers model (%s) or a classifier", MODULES_FILE)
        refuse_conflicts(args, Mode.EMBEDDINGS)
    loaded = load_model(**options, tokenizer_path=args.tokenizer_path,
                        skip_tokenizer_init=args.skip_tokenizer_init or share_with is not None,
                        mesh=tensor_parallel_mesh(args.tp_size, dp_rank * args.tp_size,
                                                  args.ep_size))
    clock = _lap(timings, "load_model", clock)
    if share_with is not None:
        loaded.tokenizer = share_with.tokenizer
    config = loaded.config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(loaded.model)))
    # INFO names the model; where it is on this machine is for --log-level debug.
    logger.info("Load weight end.%s type=%s, dtype=%s, mem usage=%.2f GB, from %s%s",
                f" [DP{dp_rank}]" if args.dp_size > 1 else "", config.architecture,
                np.dtype(loaded.dtype).name, weight_bytes / 2**30,
                loaded.name, " (dummy weights)" if args.load_format == "dummy" else "")
    logger.debug("Weights of %s read from %s", loaded.name, loaded.source)
    tokenizer = loaded.tokenizer
    if config.bidirectional and not embeds:
        raise ValueError(f"{config.architecture} is an encoder (or runs as one): it serves "
                         "embeddings (--is-embedding), not text")
    if config.state_layers:  # a hybrid model: per-request states (executor/state_pool.py)
        refuse_conflicts(args, Mode.LINEAR_ATTENTION)
    if args.pooler_config is not None and not embeds:
        raise ValueError("--pooler-config: this server generates text; it pools only as an "
                         "embedding server (--is-embedding)")
    pooling, classifier_head = pooling_of(args, loaded) if embeds else (None, None)
    context_length = args.context_length or config.max_position_embeddings
    if pooling is not None and pooling.max_seq_length and not args.context_length:
        # sentence-transformers' limit (vLLM's max_model_len for the model too): longer inputs
        # are refused, or cut with truncate_prompt_tokens.
        context_length = min(context_length, pooling.max_seq_length)
    platform = jax.default_backend()
    args, defaulted = platform_defaults.resolve(args, platform, loaded.mesh.devices.flat[0])
    platform_defaults.log_resolved(args, platform, defaulted)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, loaded.dtype)
    args = with_page_size(args, platform, context_length, kv_dtype)
    if config.bidirectional:
        # An encoder's input runs whole in one step (its attention sees all of it): no chunks,
        # and a step's prompt budget holds the longest input.
        args = dataclasses.replace(args, chunked_prefill_size=0,
                                   max_prefill_tokens=max(args.max_prefill_tokens,
                                                          context_length))
    page_size = args.page_size
    head = None
    if args.speculative_algorithm in ("EAGLE3", "NEXTN"):  # the draft head rides on the model
        head = loaded.model.draft_head = load_server_draft_head(args, loaded)
        clock = _lap(timings, "draft head", clock)
    snapshots = state_snapshots(args, config)  # after the requests' slots in the state pool
    num_pages = num_pages_for(config, kv_dtype, page_size,
                              max_total_tokens=args.max_total_tokens,
                              mem_fraction_static=args.mem_fraction_static,
                              device=loaded.mesh.devices.flat[0],  # this replica's
                              # Each device holds 1/tp of every page; CPU "devices" share
                              # one host's memory, so there the whole page counts.
                              tensor_parallel=args.tp_size if platform != "cpu" else 1,
                              draft_head=head and head.config,
                              # the state pool first: a slot per request, split by head
                              state_bytes=state_bytes_per_slot(config) * (
                                  args.max_running_requests + 1 + snapshots)
                              // (args.tp_size if platform != "cpu" else 1))
    if kv_dtype != loaded.dtype:
        per_token = bytes_per_token(config, kv_dtype, platform, head and head.config)
        as_model = bytes_per_token(config, loaded.dtype, platform, head and head.config)
        logger.info("KV cache dtype %s (--kv-cache-dtype %s): %d tokens in %.2f GB, where a %s "
                    "cache would hold %d", np.dtype(kv_dtype).name, args.kv_cache_dtype,
                    (num_pages - 1) * page_size, num_pages * page_size * per_token / 1e9,
                    np.dtype(loaded.dtype).name, (num_pages - 1) * page_size * per_token // as_model)
    # (A hybrid model's state pool was sized for the requests already set.)
    if "max_running_requests" in defaulted and platform != "cpu" and not config.state_layers:
        running = platform_defaults.running_requests_for_pool(platform, num_pages * page_size)
        if running != args.max_running_requests:
            logger.info("max_running_requests=%d: the KV pool holds %d tokens, %d a request",
                        running, num_pages * page_size, num_pages * page_size // running)
            args = dataclasses.replace(args, max_running_requests=running)
    lora_spec, lora_adapters = lora_setup(args, config) if args.enable_lora else (None, None)
    adapter_slots = None if lora_spec is None else AdapterSlots(lora_spec.max_loras)
    runner_class, pooled = ((ModelRunner, {"deterministic": args.enable_deterministic_inference})
                            if pooling is None
                            else (EmbeddingRunner, {"pooling_mode": pooling.mode}))
    prefix_reuse = PrefixReuse if not config.state_layers else functools.partial(
        StatePrefixReuse, snapshot_slots=range(args.max_running_requests + 1,
                                               args.max_running_requests + 1 + snapshots))
    if snapshots:
        pooled["state_snapshots"] = snapshots
    runner = runner_class(loaded, num_pages=num_pages, page_size=page_size, **pooled,
                         max_running_requests=args.max_running_requests,
                         attention_backend=args.attention_backend,
                         matmul_backend=args.matmul_backend, context_length=context_length,
                         mla_expanded_prefill_tokens=args.mla_expanded_prefill_tokens,
                         quantized_activations=args.quantized_activations,
                         verify_tokens=(args.speculative_num_draft_tokens
                                        if args.speculative_algorithm else 1),
                         lora=lora_spec, kv_cache_dtype=args.kv_cache_dtype,
                         hidden_rows=args.enable_return_hidden_states,
                         # a draft head's steps take the weights in a plain jit's layouts
                         choose_weight_layouts=False if head is not None else None)
    _lap(timings, "runner (pack)", clock)  # and the huge pages advice
    images = None
    if config.vision is not None:  # the tower runs apart from the step (vision_encoder.py)
        refuse_conflicts(args, Mode.VISION)
        model_dir = (os.path.dirname(loaded.source) if os.path.isfile(loaded.source)
                     else loaded.source)
        if config.vision.kind == "gemma3":  # SigLIP, images of one size (gemma3_images.py)
            images = gemma3_image_prompts(args, loaded, runner, tokenizer, model_dir,
                                          images_per_request(args))
        elif config.vision.kind == "llama4":  # tiles of one size (llama4_images.py)
            images = llama4_image_prompts(args, loaded, runner, tokenizer, model_dir,
                                          images_per_request(args))
        elif config.vision.kind == "gemma4":  # sizes by aspect ratio (gemma4_images.py)
            images = gemma4_image_prompts(args, loaded, runner, model_dir,
                                          images_per_request(args))
        else:
            processor = image_processor(model_dir, processor_kwargs(args))
            images = ImagePrompts(config.vision, processor,
                                  VisionEncoder(loaded, runner.kernels,
                                                max_patches(processor, config.vision)),
                                  images_per_request(args), config.hidden_size, loaded.dtype)
    if args.quantization == "int8" and runner.kernels.packed_matmul is not None:
        logger.info("--quantization int8: the int8 weights are multiplied by %s; the embedding "
                    "and LM head stay on the float GEMM",
                    ("the native quantized CPU GEMM" + (
                        ", x quantized per block of 32 (W8A8; --quantized-activations float32 "
                        "keeps float32 x)" if args.quantized_activations == "q8" else ""))
                    if native_gemm_available()
                    else "XLA's dots (the native quantized CPU GEMM does not build here)")
    buckets = serving_buckets(args, context_length, config.widest_head_dim, loaded.dtype, platform,
                              native_matmul=runner.kernels.packed_matmul is not None,
                              latent=config.mla.kernel_widths if config.mla else None,
                              kv_dtype=kv_dtype)
    runner.max_seqs = buckets.seqs[-1]  # the runner's sample rows are the buckets'
    leader = lead(args, runner) if args.nnodes > 1 else None
    draft = None
    if args.speculative_algorithm == "STANDALONE":
        clock = time.perf_counter()
        draft = _draft_model(args, loaded, tokenizer, runner, buckets, dp_rank)
        if leader is not None:  # the followers build its runner and replay it too
            leader.follow_runner(draft.runner, "draft_model_")
        clock = _lap(timings, "draft model", clock)
    draft_head = None if head is None else DraftHead(
        runner, buckets, args.speculative_num_draft_tokens - 1, args.speculative_eagle_topk or 1,
        args.speculative_num_steps or 0)
    drafter = draft or draft_head  # None: NGRAM drafts on the host, or no speculation
    host_pages = 0
    if args.enable_hierarchical_cache:  # the prefix cache's host tier (host_kv_pool.py)
        host_pages = host_tier_pages(args, num_pages,
                                     page_size * bytes_per_token(config, kv_dtype, platform),
                                     platform)
    scheduler = Scheduler(
        PageAllocator(num_pages), page_size, args.max_running_requests,
        args.chunked_prefill_size, args.max_prefill_tokens, context_length,
        # An encoder's and CLS / mean pooling's pages are never reused (pooled_outputs.py).
        radix_cache=prefix_caching(args, config, pooling), prefix_reuse=prefix_reuse,
        speculator=speculator_for(args, drafter), host_pages=host_pages,
        admission=EveryRequest() if adapter_slots is None else adapter_slots)
    host_kv = HostKvPool(runner.kv_specs, host_pages) if host_pages else None
    if args.dp_size > 1:
        scheduler.log.prefix = f"[DP{dp_rank}] "
    eos_token_ids = set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_token_ids.add(tokenizer.eos_token_id)
    grammar_backend = None
    if share_with is not None:
        grammar_backend = share_with.grammar_backend
    elif args.grammar_backend != "none" and tokenizer is not None and pooling is None:
        grammar_backend = GrammarBackend(tokenizer, config.vocab_size, sorted(eos_token_ids),
                                         args.constrained_json_whitespace_pattern)
    if not args.disable_precompile:
        clock = time.perf_counter()
        cache = None
        # No compilation cache folder: it was refused (cache_root.private_dir), so is any in it.
        if (compilation_cache_dir is not None and not args.disable_executable_cache
                and enabled_by_environment()):
            cache = ExecutableCache.open(os.path.join(compilation_cache_dir, "executables"))
        runner.precompile(buckets.all_shapes(), cache=cache, tree_shapes=buckets.tree_shapes(),
                          tree_width=buckets.tree_width, threads=args.precompile_threads)
        if draft is not None:
            draft.runner.precompile(buckets.all_shapes(), cache=cache,
                                    threads=args.precompile_threads)
        if draft_head is not None:
            draft_head.precompile(args.max_running_requests)
        if images is not None:
            images.encoder.precompile()
        if host_kv is not None:
            host_kv.precompile()
        if cache is not None:
            logger.info("Serving steps: %d loaded, %d compiled (executable cache)",
                        cache.loaded, cache.compiled)
            logger.debug("Executable cache: %s", cache.directory)
        clock = _lap(timings, "precompile", clock)
        runner.kv_caches  # noqa: B018 - waits for the pool's thread
        _lap(timings, "KV pool (left to wait for)", clock)
    return EngineParts(args=args, loaded=loaded, tokenizer=tokenizer,
                       context_length=context_length, runner=runner, buckets=buckets,
                       scheduler=scheduler, eos_token_ids=eos_token_ids,
                       grammar_backend=grammar_backend, startup_timings=timings,
                       thread_name=f"xlaserve-engine-dp{dp_rank}" if args.dp_size > 1
                       else "xlaserve-engine",
                       group=leader or OneProcess(),
                       draft=draft, draft_head=draft_head, lora_adapters=lora_adapters,
                       adapter_slots=adapter_slots,
                       pooling=pooling, classifier_head=classifier_head, images=images,
                       host_kv=host_kv,
                       hidden_states=HiddenStates(config.hidden_size, args.max_hidden_state_values)
                       if args.enable_return_hidden_states else NO_HIDDEN_STATES)


def _draft_model(args, loaded, tokenizer, runner: ModelRunner, buckets: Buckets,
                 dp_rank: int) -> DraftModel:
    """The STANDALONE draft model on the target's devices, with the target's pages, slots and
    buckets (executor/drafts/draft_model.py). One whose vocabulary is not the target's stops start-up."""
    options = {**server_load_options(args), "model_path": args.speculative_draft_model_path}
    draft_loaded = load_model(**options, skip_tokenizer_init=tokenizer is None,
                              mesh=tensor_parallel_mesh(args.tp_size, dp_rank * args.tp_size,
                                                        args.ep_size))
    if draft_loaded.config.vocab_size != loaded.config.vocab_size:
        raise ValueError(f"--speculative-draft-model-path {args.speculative_draft_model_path}: "
                         f"its vocabulary has {draft_loaded.config.vocab_size} tokens, the "
                         f"model's {loaded.config.vocab_size}; a draft model must share the "
                         "model's tokenizer")
    if (tokenizer is not None and draft_loaded.tokenizer is not None
            and draft_loaded.tokenizer.get_vocab() != tokenizer.get_vocab()):
        raise ValueError(f"--speculative-draft-model-path {args.speculative_draft_model_path}: "
                         "its tokenizer's vocabulary is not the model's")
    logger.info("Draft model loaded: %s, %s", draft_loaded.config.architecture,
                draft_loaded.name)
    draft_runner = ModelRunner(draft_loaded, num_pages=runner.num_pages,
                               page_size=runner.page_size,
                               max_running_requests=args.max_running_requests,
                               attention_backend=args.attention_backend,
                               matmul_backend=args.matmul_backend,
                               context_length=runner.context_length,
                               verify_tokens=runner.verify_tokens,
                               kv_cache_dtype=args.kv_cache_dtype)
    draft_runner.max_seqs = runner.max_seqs
    return DraftModel(draft_runner, buckets)


def lora_adapters(parts: EngineParts, wait) -> LoraAdapters | None:
    """--enable-lora: the adapters by name (lora_adapters.py), --lora-paths' loaded (the first
    --max-loras-per-batch written into the slots); else None. `wait(message)`: EngineCore._wait,
    for loads and unloads."""
    runner = parts.runner
    if parts.adapter_slots is None:
        return None
    adapters = LoraAdapters(runner, parts.scheduler, parts.adapter_slots,
                            parts.args.max_loaded_loras, parts.loaded.config, wait)
    for adapter in parts.lora_adapters or ():
        adapters.install(adapter)
    return adapters


def step_pipeline(parts: EngineParts, live_requests,
                  lora: LoraAdapters | None) -> GenerationSteps | PooledSteps:
    """The steps the engine loop stages, sends and reads: an embedding server's, or a generation
    server's with the hooks of the features it was started with, in their order (steps.py)."""
    if parts.pooling is not None:
        return PooledSteps(parts.runner, parts.buckets, parts.scheduler, parts.pooling,
                           token_types=parts.loaded.config.encoder is not None)
    host_tier = parts.host_kv and HostTierCopies(parts.host_kv, parts.runner,
                                                 parts.scheduler.cache.host.take_copies)
    hooks = [host_tier, lora, parts.images, parts.draft]
    return GenerationSteps(parts.runner, parts.buckets, parts.scheduler, live_requests,
                           parts.grammar_backend, [h for h in hooks if h is not None],
                           images=parts.images, hidden_states=parts.hidden_states)


def speculator_for(args: ServerArgs, drafter) -> Speculator | NoSpeculation:
    """The scheduler's Speculator with --speculative-algorithm, else NoSpeculation. `drafter`:
    the draft model or head whose `propose` drafts (None: NGRAM, on the host)."""
    config = SpeculativeConfig.from_server_args(args)
    return NoSpeculation() if config is None else Speculator(config, drafter and drafter.propose)


def _lap(timings: dict[str, float], phase: str, since: float) -> float:
    now = time.perf_counter()
    timings[phase] = now - since
    return now
