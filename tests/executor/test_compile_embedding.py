"""An embedding server's step (issue 54) compiled for one H100 and for TPU v6e (2x2, tensor
parallel over 4 chips) without the hardware (runtime/executor/aot.py): a BERT-base encoder's
(bidirectional attention: JAX's Pallas flash attention on the GPU and splash attention on the
TPU, with the causal mask off; no KV cache), a ModernBERT-base's (local layers: splash's local
mask on the TPU, the blocked jnp form on the GPU) and a Qwen3-Embedding decoder's (the paged
attention kernels), with the platform's real compilers (Mosaic's layout and memory checks)."""
import json

import pytest

from tests.compile_targets import devices, first_layers
from xlaserve.runtime.executor.embedding_step import compiled_for_target
from xlaserve.server_args import ServerArgs

BERT_BASE = dict(architectures=["BertModel"], model_type="bert", hidden_size=768,
                 intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                 vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
                 hidden_act="gelu", layer_norm_eps=1e-12, position_embedding_type="absolute")


MODERNBERT_BASE = dict(architectures=["ModernBertModel"], model_type="modernbert", hidden_size=768,
                       intermediate_size=1152, num_hidden_layers=3, num_attention_heads=12,
                       vocab_size=50368, max_position_embeddings=8192, local_attention=128,
                       global_attn_every_n_layers=3, hidden_activation="gelu", norm_bias=False)


@pytest.mark.parametrize("target,tp_size", [
    ("h100", 1),
    ("v6e:2x2", 4)])
@pytest.mark.parametrize("model", ["bert-base", "modernbert-base", "qwen3-embedding"])
def test_embedding_step_compiles(target, tp_size, model, tmp_path):
    devices(target)  # skips where the compile-only package is absent
    if model == "bert-base":  # 2 of BERT-base's 12 layers: each compiles alike
        (tmp_path / "config.json").write_text(json.dumps(BERT_BASE))
        path, mode = str(tmp_path), "cls"
    elif model == "modernbert-base":  # a global layer and two local ones (splash's local mask)
        (tmp_path / "config.json").write_text(json.dumps(MODERNBERT_BASE))
        path, mode = str(tmp_path), "mean"
    else:  # Qwen3-Embedding-0.6B's shapes are Qwen3-0.6B's; Qwen3-8B's config, 2 layers
        path, mode = first_layers("qwen3-8b", 2, tmp_path), "last"
    args = ServerArgs(model_path=path, tp_size=tp_size, max_running_requests=64,
                      is_embedding=True)
    # 512 tokens of 8 sequences: BERT's whole context, four of ModernBERT's 128-token windows
    # (2048 of 64 took 12.5-14.0 s each on v6e, these 3.2-11.8 s).
    compiled, weights, description = compiled_for_target(target, args, mode, 512, 8)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes > 0, description
    hlo = compiled.as_text()
    if model != "qwen3-embedding":  # the encoder's attention is the platform's flash kernel
        assert ("tpu_custom_call" in hlo) if target.startswith("v6e") else ("__gpu$xla.gpu.triton"
                                                                            in hlo or "triton" in hlo)
