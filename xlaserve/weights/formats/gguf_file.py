"""GGUF files (llama.cpp's format): tensors, config and tokenizer.

Tensors are dequantized with the `gguf` package (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16, BF16, F32 and
the rest it knows) and renamed to the Hugging Face names, so `weights.convert` handles them like
any other checkpoint. llama.cpp stores q/k rows of Llama-style models permuted for its interleaved
RoPE; we undo that so the rotate-half RoPE of the transformers layout applies.
Config and tokenizer (with the chat template from the metadata) come from `transformers`, which
reads GGUF metadata itself.

gguf's reader slices its np.memmap once per metadata string, and each slice of a memmap subclass
costs Python time (`__array_finalize__`): the default model's 98K vocabulary strings took 2.25 s
to read, 0.72 s over a plain ndarray view of the same map (`_fast_reader`). transformers reads the
file with gguf's reader twice, for the config and the tokenizer, so those reads use it too.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re

import numpy as np

# llama.cpp tensor name (without the blk.N. prefix) -> Hugging Face name.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Architectures whose q/k rows llama.cpp's converter permutes (it uses interleaved RoPE for them).
_PERMUTED_ARCHITECTURES = ("llama", "mistral")


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of q/k (interleaved pairs -> two halves)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
    )


@functools.cache
def _fast_reader():
    """gguf.GGUFReader reading through a plain ndarray view of its np.memmap (kept alive as the
    view's base): the same fields and tensors, 3x faster on a large vocabulary."""
    import gguf

    class FastGGUFReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = np.asarray(value)

    return FastGGUFReader


@contextlib.contextmanager
def _fast_reader_for_transformers():
    """transformers imports `gguf.GGUFReader` when it reads a file: it gets the fast one. Yields
    the readers transformers made, for the metadata it does not map (`_rope_scaling`) without
    reading the file once more."""
    import gguf

    readers = []

    class RecordingReader(_fast_reader()):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    original, gguf.GGUFReader = gguf.GGUFReader, RecordingReader
    try:
        yield readers
    finally:
        gguf.GGUFReader = original


class GGUFSource:
    """Tensors of one GGUF file, dequantized to float32 on demand, under Hugging Face names."""

    def __init__(self, path: str):
        import gguf

        self._gguf = gguf
        self.reader = _fast_reader()(path)
        self.architecture = self._field("general.architecture")
        self.num_heads = self._field(f"{self.architecture}.attention.head_count")
        self.num_kv_heads = self._field(f"{self.architecture}.attention.head_count_kv") or self.num_heads
        self._tensors = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is not None:
                self._tensors[name] = tensor

    def _field(self, key: str):
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

    def names(self) -> set[str]:
        return set(self._tensors)

    def raw(self, name: str) -> tuple[str, np.ndarray, int]:
        """(type name, the stored bytes [N, row bytes], K) of a 2-D tensor [N, K] as the file holds
        it (memory-mapped), q/k rows in the transformers order as `get` gives them
        (weights/kept_quantized/gguf_kept.py keeps such rows quantized)."""
        tensor = self._tensors[name]
        k, n = (int(d) for d in tensor.shape)  # fastest-first
        rows = np.asarray(tensor.data).reshape(n, -1)
        return tensor.tensor_type.name, self._unpermuted(name, rows), k

    def _unpermuted(self, name: str, rows: np.ndarray) -> np.ndarray:
        if self.architecture in _PERMUTED_ARCHITECTURES:
            if name.endswith("self_attn.q_proj.weight"):
                return unpermute_rows(rows, self.num_heads)
            if name.endswith("self_attn.k_proj.weight"):
                return unpermute_rows(rows, self.num_kv_heads)
        return rows

    def get(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        array = self._gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))
        return self._unpermuted(name, array)


def load_hf_config(path: str):
    from transformers import AutoConfig

    directory, filename = os.path.split(os.path.abspath(path))
    with _fast_reader_for_transformers() as readers:
        config = AutoConfig.from_pretrained(directory, gguf_file=filename)
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") == "default":  # not mapped by transformers (gpt-oss is)
        scaling = _rope_scaling(readers[-1].fields)
        if scaling is not None:
            config.rope_parameters = {**rope, **scaling}
    return config


# llama.cpp's rope.scaling.* keys -> transformers' rope_parameters keys. transformers maps them
# for gpt-oss only; for the others it drops them, and the model would run with unscaled RoPE.
# llama.cpp's YaRN is transformers' with truncate=True (ggml_rope_yarn_corr_dims floors and
# ceils the ramp's ends) and, with ext_factor and attn_factor 1 (the defaults), the same cos/sin
# scale, 0.1 ln(factor) + 1.
_ROPE_SCALING_KEYS = {
    "linear": {"factor": "factor"},
    "yarn": {"factor": "factor", "original_context_length": "original_max_position_embeddings",
             "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"},
}
_NEUTRAL_ROPE_SCALING = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_ext_factor": 1.0}


def _rope_scaling(fields) -> dict | None:
    """transformers' rope_parameters for the file's rope.scaling.* metadata (None: unscaled);
    a kind or key whose meaning we have not matched to transformers' is refused."""
    prefix = f"{fields['general.architecture'].contents()}.rope.scaling."
    values = {name[len(prefix):]: field.contents() for name, field in fields.items()
              if name.startswith(prefix)}
    kind = values.pop("type", "none")
    values.pop("finetuned", None)  # says whether the model was trained at the scaled length
    if kind == "none":
        return None
    values = {key: value for key, value in values.items()
              if _NEUTRAL_ROPE_SCALING.get(key) != value}
    known = _ROPE_SCALING_KEYS.get(kind, {})
    if "factor" not in values or (kind == "yarn" and "original_context_length" not in values) \
            or not set(values) <= set(known):
        supported = "; ".join(f"{name} with {', '.join(keys)}"
                              for name, keys in _ROPE_SCALING_KEYS.items())
        raise ValueError(f"GGUF rope scaling {kind!r} with {sorted(values)} is not supported "
                         f"(supported: {supported})")
    return {"rope_type": kind, **{known[key]: int(value) if key == "original_context_length"
                                  else float(value) for key, value in values.items()}}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    directory, filename = os.path.split(os.path.abspath(path))
    with _fast_reader_for_transformers():
        return AutoTokenizer.from_pretrained(directory, gguf_file=filename)
