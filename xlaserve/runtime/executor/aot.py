"""Compiles the serving step for hardware that is not here: TPU through libtpu's compile-only
topologies, NVIDIA H100 through the jax CUDA plugin's deviceless target, from a CPU machine.

    python -m xlaserve.runtime.executor.aot --target v6e:2x2 --tp-size 4 \
        --model-path benchmarks/configs/llama-3.1-8b
    python -m xlaserve.runtime.executor.aot --target h100 --model-path benchmarks/configs/qwen2.5-7b
    python -m xlaserve.runtime.executor.aot --target h100x8 --tp-size 4 --variants plain \
        --model-path benchmarks/configs/gemma-3-27b-text

Nothing is allocated: weights, KV caches and step inputs are ShapeDtypeStructs carrying the
shardings a server gives them, and the program is `step_program.make_step`, the one a server
runs, with the platform's kernels (Pallas Mosaic on TPU, Pallas Triton on GPU) and its program
variants (runtime/sampling/step_needs.py: no conditional on an accelerator), its weights in the layouts
XLA chose for them at the first compile, as a server stores them. XLA compiles it
for the target, and Mosaic or Triton compile the kernels inside it, with their layout, alignment
and memory checks, which interpret mode on CPU skips. Needs `libtpu` (TPU targets) or
`jax-cuda13-plugin` + `jax-cuda13-pjrt` (GPU) importable, and JAX_PLATFORMS=cpu.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.fp8_kv_cache import resolve_kv_cache_dtype
from xlaserve.model.lora import LoraSpec
from xlaserve.weights.draft_head import draft_head_builder, hf_config_of
from xlaserve.weights.loader import read_config, resolve_dtype
from xlaserve.model.registry import model_class
from xlaserve.model.config.layer_shapes import replicate_kv_heads
from xlaserve.model.sharding import check_split, serving_mesh, tensor_parallel_size
from xlaserve.model.linear_attention import LinearState
from xlaserve.model.mamba2 import Mamba2State
from xlaserve.model.transformer import abstract_parameters
from xlaserve.runtime.executor.drafts.draft_head import make_chain
from xlaserve.runtime.executor.drafts.draft_tree import make_tree_chain
from xlaserve.runtime.executor.kv_pool import DraftHeadPool, kv_pool_specs, layer_pool_arrays
from xlaserve.runtime.executor.state_pool import StateCopies, copy_capacity
from xlaserve.runtime.executor.forward_batch import sample_rows_for
from xlaserve.runtime.executor.buckets import serving_buckets, with_page_size
from xlaserve.runtime.executor.kernels import kernels_for
from xlaserve.runtime.executor.lora_slots import abstract_slot_args, slots_for
from xlaserve.runtime.executor.step_program import LoraArgs, make_step
from xlaserve.runtime.executor.page_table import empty_writes, write_capacity
from xlaserve.runtime.executor.step_inputs import RopeTable, idle_vectors, step_args
from xlaserve.runtime.executor.weight_args import (abstract_args, auto_formats, leaf_names,
                                                  weight_args, weight_formats)
from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens
from xlaserve.runtime.sampling.step_needs import ACCELERATOR_VARIANTS, EVERYTHING, VARIANT_NAMES, StepNeeds
from xlaserve.server_args import ServerArgs, platform_defaults

# libtpu refuses single-chip ones (v6e:1x1). The big ones hold DeepSeek-V3 (671B) in bfloat16.
TPU_TOPOLOGIES = ("v5e:2x2", "v6e:2x2", "v6e:2x4", "v5p:2x2x1", "v5p:2x4x4", "v6e:8x8")
GPU_TARGETS = ("h100", "h100x8")  # one H100 SXM; one host of eight
DEFAULT_KV_TOKENS = 1 << 16  # the KV pool without --max-total-tokens (no memory to size it from)


class TargetUnavailable(RuntimeError):
    """The compile-only package for this target is not installed."""


def use_compile_only_packages(path: str | os.PathLike | None = None) -> None:
    """Makes the compile-only packages importable: `make test` installs libtpu and the CUDA plugin
    into `.venv/aot`, outside the serving environment, where a CPU server would otherwise try to
    start them. Call before JAX starts a backend. Keeps JAX itself on the CPU, and lets several
    processes load libtpu (it takes a lock file otherwise, and a second process fails). Does
    nothing where the folder is absent."""
    path = Path(path or Path(sys.prefix) / "aot")
    if not path.is_dir():  # e.g. on a GPU machine, whose JAX must keep its own platforms
        return
    if str(path) not in sys.path:
        sys.path.append(str(path))
    if not jax.config.jax_platforms:  # the environment's JAX_PLATFORMS, read at import
        jax.config.update("jax_platforms", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    _keep_libtpu_to_this_process()


def _keep_libtpu_to_this_process() -> None:
    """Importing libtpu sets TPU_LIBRARY_PATH, which every process started afterwards inherits:
    JAX there loads libtpu from it, outside `.venv/aot`. A CPU server a test started after a TPU
    compile in its process so loaded libtpu and logged its init errors; in CI one such server died
    of a SIGSEGV, printed by libtpu's failure handler (issue 71; not reproduced here). JAX here
    finds the library through the package instead (cloud_tpu_init.get_tpu_library_path), so the
    variable goes; one set before stays."""
    if "TPU_LIBRARY_PATH" in os.environ:
        return
    try:
        importlib.import_module("libtpu")  # sets the variable, once per process
    except ImportError:
        return
    os.environ.pop("TPU_LIBRARY_PATH", None)


def target_devices(target: str) -> tuple[str, list]:
    """(platform, devices) of a compile-only target: one of TPU_TOPOLOGIES or GPU_TARGETS."""
    from jax.experimental import topologies

    try:
        if target in TPU_TOPOLOGIES:
            return "tpu", topologies.get_topology_desc(topology_name=target, platform="tpu").devices
        if target in GPU_TARGETS:
            # slices x hosts x devices per host
            topology = "1x1x8" if target == "h100x8" else "1x1x1"
            return "gpu", topologies.get_topology_desc(
                platform="cuda", target_config=h100_target_config(), topology=topology).devices
    except Exception as error:  # no libtpu / CUDA plugin: jax says so in several ways
        raise TargetUnavailable(f"cannot make compile-only {target} devices (install libtpu for "
                                f"TPU, jax-cuda13-plugin and jax-cuda13-pjrt for GPU): "
                                f"{str(error).strip().splitlines()[0]}") from None
    raise ValueError(f"unknown target {target!r}; one of {TPU_TOPOLOGIES + GPU_TARGETS}")


def h100_target_config() -> str:
    """What XLA needs to know of an H100 SXM to compile for it (GpuTargetConfigProto text)."""
    return Path(__file__).with_name("h100_target_config.txtpb").read_text()


def abstract(shape, dtype, mesh: Mesh, spec=P()) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec))


@dataclasses.dataclass
class StepProgram:
    """The serving step and abstract arguments for one bucket shape at a time."""
    step: callable
    args: tuple  # weights, kv caches, output counts, last tokens, page table, prompt masks
    inv_freq: np.ndarray
    mesh: Mesh
    page_size: int
    # The step with its weights' layouts left to XLA, which the next compile uses; it then keeps
    # the layouts chosen (in `args`' weights) for every later one, as a server does
    # (ModelRunner.precompile). None: chosen already, or the default layouts.
    choosing_step: callable | None = None
    verify_tokens: int = 1  # speculative decoding's verified row (forward_batch.sample_rows_for)
    max_seqs: int = 0  # the largest sequence bucket
    chain: callable | None = None  # a draft head's draft steps (draft_head.make_chain)
    lora: LoraSpec | None = None  # the LoRA slots among the weights
    tree_width: int = 0  # > 0: the server verifies trees (its tree program, `compile(tree=)`)
    # A vision model's step: it also takes its rows' image embeddings [tokens, hidden].
    input_embeds: tuple[int, int, object] | None = None  # (levels, hidden, dtype)
    state_copies: int = 0  # a hybrid model's state copies a step (state_pool.copy_capacity)

    def lowering_args(self, tokens: int, seqs: int, pages: int,
                      needs: StepNeeds = EVERYTHING, tree: bool = False) -> tuple[tuple, dict]:
        """The step's (abstract) arguments and static keyword arguments for one bucket shape and
        variant (`tree`: the tree program's)."""
        rows = sample_rows_for(tokens, seqs, self.verify_tokens, self.max_seqs)
        vectors, layout = self._idle_vectors(tokens, seqs, pages, rows,
                                             self.tree_width if tree else 0)
        vocab = self.args[2].shape[1]
        masks = abstract((rows, -(-vocab // 32)), jnp.int32, self.mesh)  # the grammar masks
        embeds = ()
        if self.input_embeds is not None:
            levels, hidden, dtype = self.input_embeds
            embeds = (abstract((levels, tokens, hidden), dtype, self.mesh),)
        vectors = tuple(abstract(v.shape, v.dtype, self.mesh) for v in vectors)
        return step_args(self.args, vectors, masks, embeds), {"layout": layout, "needs": needs}

    def _idle_vectors(self, tokens: int, seqs: int, pages: int, rows: int, tree_width: int = 0):
        """An idle step's host vectors and layouts (step_inputs.idle_vectors, as a server's
        runner makes them), with no page table: its writes all unused."""
        return idle_vectors(RopeTable(self.inv_freq),
                            empty_writes(write_capacity(tokens, seqs, self.page_size), 0),
                            StateCopies.of((), (), self.state_copies), tokens, seqs, pages, rows,
                            tree_width)

    def compile(self, tokens: int, seqs: int, pages: int, needs: StepNeeds = EVERYTHING,
                tree: bool = False):
        """The program of one bucket shape and variant (by default the one with every part, the
        most memory and work an accelerator server precompiles for the shape; `tree`: of a step
        with tree rows). The first compile chooses the weights' layouts (`choosing_step`)."""
        args, kwargs = self.lowering_args(tokens, seqs, pages, needs, tree)
        with jax.set_mesh(self.mesh):
            compiled = (self.choosing_step or self.step).trace(*args, **kwargs).lower().compile()
        if self.choosing_step is not None:
            weights = abstract_args(self.args[0], weight_formats(compiled))
            self.args, self.choosing_step = (weights, *self.args[1:]), None
        return compiled


    def compile_chain(self, tokens: int, seqs: int, pages: int):
        """A draft head's draft steps for one bucket shape (after `compile`, whose weight
        layouts they take)."""
        rows = sample_rows_for(tokens, seqs, self.verify_tokens, self.max_seqs)
        vectors, (layout, _) = self._idle_vectors(tokens, seqs, pages, rows)
        ints, floats = (abstract(v.shape, v.dtype, self.mesh) for v in vectors[:2])
        rooms = abstract((seqs,), jnp.int32, self.mesh)
        weights, caches, _, _, page_table, _ = self.args
        with jax.set_mesh(self.mesh):
            return self.chain.trace(weights, caches, page_table, ints, floats, rooms,
                                    layout=layout).lower().compile()


def step_program(config: ModelConfig, dtype, mesh: Mesh, platform: str, *, num_pages: int,
                 page_size: int, max_running_requests: int, context_length: int,
                 attention_backend: str = "auto", quantization=None,
                 mla_expanded_prefill_tokens: int = 0, verify_tokens: int = 1,
                 max_seqs: int = 0, draft_head=None, tree_width: int = 0, topk: int = 1,
                 tree_steps: int = 0, lora: LoraSpec | None = None,
                 kv_dtype=None, deterministic: bool = False) -> StepProgram:
    """`make_step` over abstract weights and caches sharded on `mesh`, for `platform`, with a
    page table as wide as `context_length`'s pages.
    `quantization`: "int8", "fp8" or an FP8 checkpoint's layout (int8.Fp8Checkpoint).
    `draft_head`: a speculative draft head's abstract module (model/draft_heads.py, under
    nnx.eval_shape): the step catches it up, and `StepProgram.compile_chain` compiles its
    draft steps (with `topk` > 1 its tree drafting, `tree_steps` deep, and the step's tree
    program verifies rows of `tree_width`). `lora`: the LoRA adapter slots' shapes, whose
    arrays follow the weights (runtime/executor/lora_slots.py). `kv_dtype`: the KV cache's
    (None: `dtype`; an FP8 one, model/fp8_kv_cache.py). `deterministic`: the kernels of
    --enable-deterministic-inference (kernels.deterministic_kernels)."""
    kernels = kernels_for(attention_backend, mesh, matmul_backend="xla", platform=platform,
                          mla_expanded_prefill_tokens=mla_expanded_prefill_tokens,
                          deterministic=deterministic)
    num_slots, vocab = max_running_requests + 1, config.vocab_size
    graphdef, _, parameters = abstract_parameters(config, dtype, mesh,
                                                  model_class(config.architecture),
                                                  quantization, draft_head)
    # A head's state rides at the end of the pool's list (kv_pool.DraftHeadPool).
    pool = None if draft_head is None else DraftHeadPool(draft_head.config, num_slots)
    state = nnx.from_flat_state(parameters)
    leaves, state_treedef = jax.tree.flatten(state)
    weights, weight_layout = weight_args(leaves, stack_small=mesh.size == 1,
                                         stack_layers=platform == "tpu", names=leaf_names(state))
    caches = kv_pool_specs(config, num_pages, page_size, kv_dtype or dtype, mesh, pool,
                           num_slots)
    kv_sharding = jax.tree.map(lambda cache: cache.sharding, caches)
    lora_args = None
    if lora is not None:  # after the model's weights (as ModelRunner)
        lora_args = LoraArgs(lora, config.num_layers, len(weights))
        weights = weights + abstract_slot_args(lora, config, dtype, mesh, num_slots)
    takes_images = config.vision is not None
    steps = [make_step(graphdef, state_treedef, weight_layout, kernels, mesh, kv_sharding,
                       formats, verify_tokens, lora_args, takes_images=takes_images)
             for formats in (None, auto_formats(weights))]
    parts = (graphdef, state_treedef, weight_layout, kernels, mesh, kv_sharding,
             layer_pool_arrays(config))
    chain = None
    if draft_head is not None:
        chain = (make_tree_chain(*parts, topk, tree_steps) if topk > 1
                 else make_chain(*parts, verify_tokens - 2))
    args = (weights, caches, abstract((num_slots, vocab), jnp.int32, mesh),
            abstract((num_slots,), jnp.int32, mesh),
            abstract((num_slots, pages_for_tokens(context_length, page_size)), jnp.int32, mesh),
            abstract((num_slots, vocab), jnp.bool_, mesh))
    # With a draft head the weights keep their default layouts (ModelRunner: its draft steps
    # take the same weights); LoRA slots are chosen with the weights (LoraSlots.adopt).
    choosing = steps[1] if draft_head is None else None
    return StepProgram(steps[0], args, config.rope_inv_freq(), mesh, page_size,
                       choosing, verify_tokens, max_seqs, chain, lora, tree_width,
                       (config.vision.levels, config.hidden_size, dtype) if takes_images else None,
                       copy_capacity(config))


def vision_tower_compiled(config: ModelConfig, dtype, mesh: Mesh, platform: str, patches: int,
                          attention_backend: str = "auto"):
    """A vision model's tower (runtime/executor/vision_encoder.py's program) compiled for
    `platform`'s devices of `mesh`, over abstract weights, for a run of `patches` patches
    (Gemma 3's SigLIP, siglip_encoder.py: one image, whatever `patches`; Llama 4's encoder,
    llama4_encoder.py: the tiles that hold them, one at least; Gemma 4's, gemma4_encoder.py: one
    image padded to `patches`)."""
    from xlaserve.runtime.executor.towers import gemma4_encoder, llama4_encoder, siglip_encoder
    from xlaserve.runtime.executor.vision_encoder import device_args, idle_batch, tower_program

    kernels = kernels_for(attention_backend, mesh, matmul_backend="xla", platform=platform)
    graphdef, _, parameters = abstract_parameters(config, dtype, mesh,
                                                  model_class(config.architecture))
    model = nnx.merge(graphdef, nnx.from_flat_state(parameters))
    tower_graph, tower_state = nnx.split(model.vision)
    if config.vision.kind == "gemma3":
        pixels = siglip_encoder.idle_pixels(config.vision)
        with jax.set_mesh(mesh):
            return jax.jit(siglip_encoder.tower_program(tower_graph, kernels)).trace(
                tower_state, abstract(pixels.shape, pixels.dtype, mesh)).lower().compile()
    if config.vision.kind == "llama4":
        tiles = llama4_encoder.idle_tiles(config.vision,
                                          max(1, -(-patches // config.vision.num_patches)))
        with jax.set_mesh(mesh):
            return jax.jit(llama4_encoder.tower_program(tower_graph, kernels)).trace(
                tower_state, abstract(tiles.shape, tiles.dtype, mesh)).lower().compile()
    if config.vision.kind == "gemma4":  # one image padded to a bucket of `patches`
        args = [abstract(a.shape, a.dtype, mesh)
                for a in gemma4_encoder.idle_args(config.vision, patches)]
        with jax.set_mesh(mesh):
            return jax.jit(gemma4_encoder.tower_program(tower_graph, kernels)).trace(
                tower_state, *args).lower().compile()
    batch = {k: abstract(v.shape, v.dtype, mesh)
             for k, v in device_args(idle_batch(config.vision, patches)).items()}

    with jax.set_mesh(mesh):
        return jax.jit(tower_program(tower_graph, kernels)).trace(
            tower_state, batch).lower().compile()


def lora_spec(server_args: ServerArgs) -> LoraSpec | None:
    """The LoRA slots a server with `server_args` would have without reading adapters
    (lora_slots.slots_for: rank 16 and all modules unless the flags say)."""
    return slots_for(server_args) if server_args.enable_lora else None


def server_step(target: str, server_args: ServerArgs,
                fp8_checkpoint=None) -> tuple[StepProgram, list, str]:
    """The step a server started with `server_args` would run on `target`, the bucket shapes it
    would precompile, and a one-line description. `server_args.model_path`: a directory with the
    model's config.json (weights are not read). `fp8_checkpoint` (int8.Fp8Checkpoint): the weights
    of an FP8 checkpoint kept in FP8, as the loader keeps them on a GPU with FP8 matmuls."""
    platform, devices = target_devices(target)
    server_args, _ = platform_defaults.resolve(server_args, platform)
    mesh = serving_mesh(devices, server_args.tp_size, server_args.ep_size)
    config, _ = read_config(server_args.model_path, load_format="dummy",  # reads no weights
                            revision=server_args.revision,
                            trust_remote_code=server_args.trust_remote_code)
    config = replicate_kv_heads(config, tensor_parallel_size(mesh))  # as load_model does
    check_split(config, mesh)
    dtype = resolve_dtype("bfloat16" if server_args.dtype == "auto" else server_args.dtype)
    kv_dtype = resolve_kv_cache_dtype(server_args.kv_cache_dtype, dtype)
    context_length = server_args.context_length or config.max_position_embeddings
    server_args = with_page_size(server_args, platform, context_length, kv_dtype)
    page_size = server_args.page_size
    buckets = serving_buckets(server_args, context_length, config.widest_head_dim, dtype, platform,
                              latent=config.mla.kernel_widths if config.mla else None,
                              kv_dtype=kv_dtype)
    num_pages = (server_args.max_total_tokens or DEFAULT_KV_TOKENS) // page_size + 1
    head = None
    if server_args.speculative_algorithm in ("EAGLE3", "NEXTN"):
        build, _ = draft_head_builder(server_args.speculative_algorithm,
                                      server_args.speculative_draft_model_path, config,
                                      hf_config_of(server_args.model_path), dtype)
        head = nnx.eval_shape(build)
    program = step_program(config, dtype, mesh, platform, num_pages=num_pages,
                           page_size=page_size,
                           max_running_requests=server_args.max_running_requests,
                           context_length=context_length,
                           attention_backend=server_args.attention_backend,
                           quantization=fp8_checkpoint or server_args.quantization,
                           mla_expanded_prefill_tokens=server_args.mla_expanded_prefill_tokens,
                           verify_tokens=buckets.verify_tokens, max_seqs=buckets.seqs[-1],
                           draft_head=head, tree_width=buckets.tree_width,
                           topk=server_args.speculative_eagle_topk or 1,
                           tree_steps=server_args.speculative_num_steps or 0,
                           lora=lora_spec(server_args), kv_dtype=kv_dtype,
                           deterministic=server_args.enable_deterministic_inference)
    weights = f", {server_args.quantization} weights" if server_args.quantization else ""
    if fp8_checkpoint is not None:
        weights = (f", FP8 checkpoint weights ({fp8_checkpoint.block_k}-wide K blocks)"
                   if fp8_checkpoint.block_k else ", FP8 checkpoint weights (per-channel scales)")
    if head is not None:
        weights += f", {type(head).__name__} draft head"
    if program.lora is not None:
        weights += (f", {program.lora.max_loras} LoRA slots of rank {program.lora.max_rank} on "
                    f"{len(program.lora.target_modules)} modules")
    if kv_dtype != dtype:
        weights += f", {np.dtype(kv_dtype).name} KV cache"
    if server_args.enable_deterministic_inference:
        weights += ", deterministic inference"
    description = (f"{target} ({devices[0].device_kind}), {config.architecture}, "
                   f"{np.dtype(dtype).name}{weights}, "
                   f"tp {server_args.tp_size}, ep {server_args.ep_size}, "
                   f"{num_pages} pages of {page_size}")
    return program, buckets.all_shapes(), description


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, choices=TPU_TOPOLOGIES + GPU_TARGETS)
    parser.add_argument("--all-shapes", action="store_true",
                        help="every bucket a server would precompile (default: smallest and largest)")
    parser.add_argument("--variants", default="plain,sampled,everything",
                        help="which program variants of each bucket to compile (comma-separated)")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    if unknown := set(names) - {VARIANT_NAMES[n] for n in ACCELERATOR_VARIANTS}:
        parser.error(f"--variants: unknown {sorted(unknown)} (plain, sampled, everything)")
    variants = [n for n in ACCELERATOR_VARIANTS if VARIANT_NAMES[n] in names]
    use_compile_only_packages()
    server_args = ServerArgs.from_cli_args(args)
    if server_args.model_path is None:
        parser.error("--model-path: a directory with the model's config.json")
    program, shapes, description = server_step(args.target, server_args)
    if not args.all_shapes:
        shapes = sorted({shapes[0], shapes[-1]})
    tp_size = server_args.tp_size
    weights = sum(w.size * w.dtype.itemsize for w in jax.tree.leaves(program.args[0])) / tp_size
    kv, states = (sum(leaf.size * leaf.dtype.itemsize for cache in program.args[1]
                      if isinstance(cache, (LinearState, Mamba2State)) == linear
                      for leaf in jax.tree.leaves(cache)) / tp_size for linear in (False, True))
    print(f"{description}; per device: weights {weights / 2**30:.2f} GiB, KV cache "
          f"{kv / 2**30:.2f} GiB" + (f", linear layers' states {states / 2**30:.2f} GiB"
                                     if states else "") + " (whole / tp)")
    for (tokens, seqs, pages), needs in [(s, n) for s in shapes for n in variants]:
        start = time.perf_counter()
        compiled = program.compile(tokens, seqs, pages, needs)
        memory = compiled.memory_analysis()
        print(f"  step (tokens {tokens}, seqs {seqs}, pages {pages}), {VARIANT_NAMES[needs]}: "
              f"compiled in {time.perf_counter() - start:.1f} s; per device: arguments "
              f"{memory.argument_size_in_bytes / 2**30:.2f} GiB, temporaries "
              f"{memory.temp_size_in_bytes / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
