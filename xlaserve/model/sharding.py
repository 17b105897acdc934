"""How a model is split across devices: the serving mesh and every parameter's partition spec.

One replica runs on a mesh of `tp_size` devices with axes ("data", "expert", "tensor"), shaped
(1, ep_size, tp_size / ep_size). Attention, the dense MLP, the embedding and the LM head are
tensor-parallel over all of them (`TP`, the two axes together, in device order); the experts of a
mixture-of-experts layer are split by expert over "expert" (`--ep-size`) and, within a group of
experts, by their intermediate axis over "tensor", as the dense MLP is. Without expert
parallelism the expert axis has size 1 and everything splits over "tensor".

Per device, expert parallelism holds as many expert weights as tensor parallelism does (E / ep
experts of I / (tp / ep) columns each, E * I / tp either way); what changes is the shape of the
work: whole experts make wider matmuls (Qwen3-30B-A3B's experts are 768 wide, 96 columns a device
at tp 8 without EP). How tokens meet their experts: model/moe.py.
"""
from __future__ import annotations

import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "expert", "tensor")
# The tensor-parallel devices: all of a replica's, the expert axis times the tensor axis.
TP = ("expert", "tensor")

# Partition spec of every parameter, by its leaf name.
PARTITION_SPECS = {
    "embedding": P(TP, None),
    "qkv": P(None, TP, None, None),
    "qkv_bias": P(TP, None, None),
    "o_proj": P(TP, None, None),
    "o_bias": P(),
    "sinks": P(TP),  # one per query head
    "router_scale": P(),  # Gemma 4's MoE block (moe.ExpertsBesideMlp)
    # Gemma 4's per-layer embeddings (per_layer_inputs.py): the table split by token as the
    # embedding is; the rest small, whole on every device.
    "per_layer_embedding": P(TP, None),
    "per_layer_model_projection": P(),
    "per_layer_gate": P(),
    "per_layer_projection": P(),
    "per_expert_scale": P(),
    "gate_up": P(None, None, TP),
    "down": P(TP, None),
    "lm_head": P(None, TP),
    "scale": P(),
    "layer_scalar": P(),  # Gemma 4's, one per layer
    # Mixture of experts (moe.py): experts over "expert", each one's intermediate axis over
    # "tensor"; the router is replicated (every device routes every token).
    "router": P(),
    "experts_gate_up": P("expert", None, None, "tensor"),
    "experts_down": P("expert", "tensor", None),
    "shared_expert_gate": P(),
    "router_bias": P(),
    "router_correction_bias": P(),
    "experts_gate_up_bias": P("expert", None, "tensor"),
    # Added once, outside the experts' matmuls (moe.py), where every device holds every token.
    "experts_down_bias": P(),
    # Multi-head latent attention (mla.py): the heads split, the latent projections replicated
    # (every head reads every token's latent row).
    "q_a_proj": P(),
    "q_b_proj": P(None, TP, None),
    "q_proj": P(None, TP, None),
    "kv_a_proj": P(),
    "w_uk": P(TP, None, None),
    "w_uv": P(TP, None, None),
    # Speculative draft heads (draft_heads.py): their input projections (small) and EAGLE-3's
    # draft-to-target id table, replicated.
    "fc": P(),
    "eh_proj": P(),
    "draft_to_target": P(),
    # BERT-family encoders (encoders/encoder.py): the word embedding (whole: gathered, never
    # multiplied, and the vocabularies do not split evenly), learned positions and token types,
    # LayerNorm biases, the MLP's up projection and biases (qkv, o_proj, down as the decoder's).
    "word_embedding": P(),
    "position_embedding": P(),
    "token_type_embedding": P(),
    "bias": P(),
    "up": P(None, TP),
    "up_bias": P(TP),
    "down_bias": P(),
    # Vision towers (vision/qwen_vision.py): the patch embedding whole; the gated MLP's biases as
    # its gate_up; the rest by the decoder's names.
    "patch_embed": P(),
    "patch_embed_bias": P(),
    "pos_embed": P(),  # Qwen3-VL's learned positions, gathered by taps
    "gate_up_bias": P(None, TP),
    "projection": P(),  # Gemma 3's projector (vision/siglip_vision.py): the decoder rows whole
    "class_embedding": P(),  # Llama 4's encoder (vision/llama4_vision.py)
    "bounds": P(),  # Gemma 4's clipped projections' bounds (vision/gemma4_vision.py)
    # Hybrid linear-attention models: the full layers' output gate by query head, as q; the
    # Gated DeltaNet layers (linear_attention.py) by key head and its value heads, as attention
    # (their states too: DELTA_STATE_SPEC, CONV_STATE_SPEC), out_proj's partial sums added across devices.
    "output_gate": P(None, TP, None),
    "in_proj_qkv": P(None, TP, None),
    "in_proj_z": P(None, TP, None),
    "in_proj_ba": P(None, None, TP),
    "conv_weight": P(TP, None, None),
    "A_log": P(TP),
    "dt_bias": P(TP),
    "gated_norm": P(),
    "out_proj": P(TP, None, None),
    # Nemotron-H's Mamba-2 layers (mamba2.py) by group, as attention by KV head: their heads
    # with them (conv_weight, A_log, dt_bias, in_proj_z, out_proj above), their states too
    # (CONV_STATE_SPEC, DELTA_STATE_SPEC); its ReLU^2 MLP's `up` and `down` as the encoders'.
    "in_proj_xbc": P(None, TP, None),
    "in_proj_dt": P(None, TP),
    "conv_bias": P(TP, None),
    "D": P(TP),
    "group_norm": P(TP, None),
}
# The KV cache of one layer, [num_pages, page_size, 2 * kv_heads * head_dim] (kv_cache_shape),
# split by kv head: each device holds the K|V pairs of its own heads, contiguous.
KV_CACHE_SPEC = P(None, None, TP)
# Multi-head latent attention's cache, [num_pages, page_size, kv_lora + rope]: every head reads
# every row, so each device holds it whole (SGLang's tensor-parallel MLA does the same).
LATENT_CACHE_SPEC = P()


# A linear layer's state pools (linear_attention.LinearState), by head: the delta rule's
# [slots, Hv, Dk, Dv], the convolution's window [slots, W - 1, Hk, channels]; a Mamba-2 layer's
# (mamba2.Mamba2State) alike: [slots, H, P, N] and [slots, W - 1, G, channels].
DELTA_STATE_SPEC = P(None, TP, None, None)
CONV_STATE_SPEC = P(None, None, TP, None)


def kv_cache_spec(config) -> P:
    """The partition spec of one layer's cache (ModelConfig `config`)."""
    return LATENT_CACHE_SPEC if config.mla is not None else KV_CACHE_SPEC


def partition_spec(path: tuple) -> P:
    """The PartitionSpec of the parameter at `path` (a tuple of state keys)."""
    return PARTITION_SPECS[str(path[-1])]


def serving_mesh(devices, tp_size: int, ep_size: int = 1) -> Mesh:
    """The mesh of one replica over the first `tp_size` of `devices`."""
    check_parallel_sizes(tp_size, ep_size)
    if tp_size > len(devices):
        raise ValueError(f"--tp-size {tp_size} needs that many devices; found {len(devices)}")
    grid = np.array(list(devices)[:tp_size]).reshape(1, ep_size, tp_size // ep_size)
    return Mesh(grid, MESH_AXES)


def check_parallel_sizes(tp_size: int, ep_size: int) -> None:
    if tp_size < 1 or ep_size < 1:
        raise ValueError(f"--tp-size and --ep-size must be at least 1 (got {tp_size}, {ep_size})")
    if tp_size % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide --tp-size {tp_size}: the experts are "
                         "split over the tensor-parallel devices")


def tensor_parallel_size(mesh: Mesh) -> int:
    """The devices attention and the dense MLP split over: the expert and tensor axes (TP)."""
    return mesh.shape.get("expert", 1) * mesh.shape.get("tensor", 1)


def check_split(config, mesh: Mesh) -> None:
    """What the mesh splits of a model (ModelConfig `config`) must split evenly, or start-up
    stops naming it: its experts over the expert axis; each layer's KV heads (latent attention:
    its query heads; a linear layer: its key heads) over all the devices, which attention is
    split by."""
    ep_size = mesh.shape.get("expert", 1)
    if ep_size > 1 and config.num_experts % ep_size:
        raise ValueError(f"--ep-size {ep_size} does not divide the model's {config.num_experts} "
                         "experts")
    tp_size = tensor_parallel_size(mesh)
    linear = config.linear_attention
    if linear is not None and config.state_layers and linear.num_key_heads % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the linear layers' "
                         f"{linear.num_key_heads} key heads (they are split by key head)")
    if config.mamba2 is not None and config.mamba2.num_groups % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the Mamba-2 layers' "
                         f"{config.mamba2.num_groups} groups (they are split by group)")
    if config.mla is not None:
        if config.num_heads % tp_size:
            raise ValueError(f"--tp-size {tp_size} does not divide the model's "
                             f"{config.num_heads} attention heads")
        return
    for i in range(config.num_layers):
        kv_heads = config.layer(i).num_kv_heads
        if kv_heads % tp_size:  # config.layer_shapes.replicate_kv_heads copies them where it can
            raise ValueError(f"--tp-size {tp_size} does not divide layer {i}'s {kv_heads} KV "
                             "heads (attention is split by KV head)")
