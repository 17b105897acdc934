"""Write a tiny Hugging Face Llama as a GGUF file the way llama.cpp's converter does: llama.cpp
tensor names, q/k rows permuted for interleaved RoPE, and any quantization type."""
import gguf
import numpy as np

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Block layouts of the K-quants, which gguf-py can read but not write: we fill them with random
# bits and valid float16 scales.
_K_QUANT_SCALE_OFFSETS = {
    gguf.GGMLQuantizationType.Q4_K: [0, 2],  # d, dmin at the start of each 144-byte block
    gguf.GGMLQuantizationType.Q6_K: [208],  # d at the end of each 210-byte block
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _quantize(array: np.ndarray, qtype, rng) -> np.ndarray:
    if qtype in _K_QUANT_SCALE_OFFSETS:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = array.size // block_size
        raw = rng.integers(0, 256, size=(blocks, type_size), dtype=np.uint8)
        for offset in _K_QUANT_SCALE_OFFSETS[qtype]:
            scale = rng.uniform(1e-5, 1e-4, size=blocks).astype(np.float16)
            raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(blocks, 2)
        return raw.reshape(array.shape[0], -1)
    return gguf.quants.quantize(array, qtype)


def _add_rope_scaling(writer, rope: dict) -> None:
    """The rope.scaling.* keys llama.cpp's converter writes for linear and YaRN scaling."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType(kind))
    writer.add_rope_scaling_factor(rope["factor"])
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if "beta_fast" in rope:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def write_llama_gguf(path: str, hf_model, matrix_type, seed: int = 0,
                     extra_metadata: dict | None = None, tensor_types: dict | None = None) -> None:
    """`extra_metadata`: more string keys (e.g. a rope scaling type we do not support);
    `tensor_types`: {GGUF tensor name: type} for matrices not of `matrix_type` (a Q4_K_M file's
    Q6_K attn_v and ffn_down)."""
    config = hf_model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    _add_rope_scaling(writer, config.rope_parameters)
    for key, value in (extra_metadata or {}).items():
        writer.add_string(key, value)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, rest = name[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{layer}.{_NAMES[rest]}"
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = ((tensor_types or {}).get(gguf_name, matrix_type) if array.ndim == 2
                 else gguf.GGMLQuantizationType.F32)
        data = _quantize(array, qtype, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)  # uint8 data: shape is in bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
