"""An embedding server's engine (issue 54): `Engine.encode` on a decoder embedding checkpoint as
Qwen3-Embedding ships equals sentence-transformers' `encode`, for each pooling mode, whole and
chunked prompts, texts and token ids, with nothing compiled while serving."""
import numpy as np
import pytest

from tests.embedding_models import save_decoder_embedding
from xlaserve.offline import Engine

pytest.importorskip("sentence_transformers")

SENTENCES = ["the cat sat on a mat", "dog", "a dog ran on the mat the mat the cat sat on a dog"]
# Prompt pieces of 4 tokens: the longer sentences run in 2 and 4 chunks.
SMALL = dict(dtype="float32", page_size=4, max_running_requests=4, chunked_prefill_size=4,
             max_prefill_tokens=8, max_total_tokens=256)


def cosine(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("mode", ["lasttoken", "mean", "cls"])
def test_encode_equals_sentence_transformers_over_chunked_prompts(tmp_path, mode):
    path, reference = save_decoder_embedding(tmp_path, mode, normalize=mode != "cls")
    expected = reference.encode(SENTENCES, convert_to_numpy=True)
    with Engine(path, is_embedding=True, **SMALL) as engine:
        compiled = engine.core.runner.compile_count()
        outputs = engine.encode(SENTENCES)
        by_ids = engine.encode(input_ids=[engine.tokenizer.encode(s) for s in SENTENCES])
        one = engine.encode(SENTENCES[2])
        assert engine.core.runner.compile_count() == compiled  # no compile while serving
        assert len(engine.core.steps.outputs) == 0
    got = np.array([o["embedding"] for o in outputs], np.float32)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert cosine(got, expected).min() > 0.9999
    np.testing.assert_allclose(np.array([o["embedding"] for o in by_ids]), got, atol=1e-6)
    np.testing.assert_allclose(one["embedding"], got[2], atol=1e-6)
    assert [o["meta_info"]["prompt_tokens"] for o in outputs] == [6, 1, 14]
    assert outputs[0]["meta_info"]["completion_tokens"] == 0
    if mode != "cls":  # normalised
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)


def test_modules_json_makes_an_embedding_server_and_the_other_kind_is_refused(tmp_path):
    """--runner auto serves a checkpoint with modules.json as embeddings; generation on it,
    and --runner generate's encode, are refused in one line, not answered."""
    path, reference = save_decoder_embedding(tmp_path, "lasttoken")
    with Engine(path, **SMALL) as engine:
        assert engine.core.features.pooling.mode == "last" and engine.core.features.pooling.normalize
        np.testing.assert_allclose(engine.encode("the cat")["embedding"],
                                   reference.encode("the cat"), atol=1e-4)
        with pytest.raises(ValueError, match="generates no text"):
            engine.generate("the cat", {"max_new_tokens": 2})
    with Engine(path, runner="generate", **SMALL) as engine:
        assert engine.core.features.pooling is None
        with pytest.raises(ValueError, match="embeddings need an embedding model"):
            engine.encode("the cat")
        assert len(engine.generate("the cat", {"max_new_tokens": 2})["output_ids"]) == 2


def test_an_input_over_the_context_is_refused(tmp_path):
    path, _ = save_decoder_embedding(tmp_path, "mean")
    with Engine(path, is_embedding=True, context_length=8, **SMALL) as engine:
        with pytest.raises(ValueError, match="context length"):
            engine.encode(input_ids=list(range(9)))
        assert len(engine.encode(input_ids=list(range(8)))["embedding"]) == 64


def test_an_untied_checkpoint_without_its_lm_head_serves_embeddings(tmp_path):
    """An embedding server builds no LM head (ModelConfig.lm_head): a checkpoint whose config
    is untied and which ships no lm_head.weight loads; a text generator from it does not."""
    path, reference = save_decoder_embedding(tmp_path, "lasttoken", tied=False)
    with Engine(path, is_embedding=True, **SMALL) as engine:
        assert not hasattr(engine.core.loaded.model, "lm_head")
        np.testing.assert_allclose(engine.encode(SENTENCES[0])["embedding"],
                                   reference.encode(SENTENCES[0]), atol=1e-4)
    with pytest.raises(Exception, match="lm_head.weight"):
        Engine(path, runner="generate", **SMALL)


def test_a_backbone_saved_as_its_model_class_serves_embeddings(tmp_path):
    """sentence-transformers' own save of a decoder names it Qwen3Model (no LM head): read as
    the causal LM's layers. One whose config maps AutoModel to its own code (gte-Qwen2's
    auto_map) is refused in one line: that code may attend otherwise."""
    import json

    path, reference = save_decoder_embedding(tmp_path / "plain", "lasttoken",
                                             architecture="Qwen3Model")
    with Engine(path, **SMALL) as engine:
        np.testing.assert_allclose(engine.encode(SENTENCES[0])["embedding"],
                                   reference.encode(SENTENCES[0]), atol=1e-4)
    custom, _ = save_decoder_embedding(tmp_path / "custom", "lasttoken", architecture="Qwen3Model")
    config = json.loads(open(f"{custom}/config.json").read())
    config["auto_map"] = {"AutoModel": "modeling_qwen.Qwen2Model"}
    open(f"{custom}/config.json", "w").write(json.dumps(config))
    with pytest.raises(ValueError, match="maps AutoModel to its own code"):
        Engine(custom, **SMALL)


def test_a_decoder_run_bidirectionally_as_vllms_is_causal_false(tmp_path):
    """gte-Qwen2-7B-instruct's case: a backbone whose config names code of its own, served with
    vLLM's --hf-overrides is_causal false, attends each token to its whole input (no KV cache):
    transformers' model under an all-zero 4-D mask, last token, normalised. With is_causal
    true it loads as transformers' causal class (sentence-transformers' vectors)."""
    import json

    import torch
    import transformers

    path, reference = save_decoder_embedding(tmp_path, "lasttoken", architecture="Qwen3Model")
    config = json.loads(open(f"{path}/config.json").read())
    config["auto_map"] = {"AutoModel": "modeling_qwen.Qwen2Model"}
    open(f"{path}/config.json", "w").write(json.dumps(config))
    backbone = transformers.Qwen3Model.from_pretrained(str(tmp_path / "backbone")).eval()
    expected = []
    for sentence in SENTENCES:
        ids = torch.tensor([reference.tokenizer(sentence)["input_ids"]])
        with torch.no_grad():
            mask = torch.zeros(1, 1, ids.shape[1], ids.shape[1])  # every token sees every token
            last = backbone(ids, attention_mask=mask).last_hidden_state[0, -1].numpy()
        expected.append(last / np.linalg.norm(last))
    with Engine(path, hf_overrides='{"is_causal": false}', **SMALL) as engine:
        assert engine.core.loaded.config.bidirectional
        got = np.array([o["embedding"] for o in engine.encode(SENTENCES)])
    np.testing.assert_allclose(got, np.array(expected), atol=1e-4)
    assert not np.allclose(got, reference.encode(SENTENCES), atol=1e-3)  # not the causal ones
    with Engine(path, hf_overrides='{"is_causal": true}', **SMALL) as engine:
        np.testing.assert_allclose(engine.encode(SENTENCES[2])["embedding"],
                                   reference.encode(SENTENCES[2]), atol=1e-4)


def test_a_bare_decoder_pools_its_last_token_normalized_unless_pooler_config_says(tmp_path):
    """--is-embedding on a decoder checkpoint without sentence-transformers files (issue 73's
    finding: it stopped start-up) pools its last token, normalized, as SGLang and vLLM do;
    --pooler-config chooses another pooling (vLLM's flag); a generation server refuses it."""
    import os
    import shutil

    path, reference = save_decoder_embedding(tmp_path, "lasttoken")
    os.remove(os.path.join(path, "modules.json"))
    for name in os.listdir(path):
        if name.startswith("1_Pooling") or name.startswith("2_Normalize"):
            shutil.rmtree(os.path.join(path, name))
    tokens = reference.encode(SENTENCES[2], output_value="token_embeddings").numpy()
    with Engine(path, is_embedding=True, **SMALL) as engine:
        pooling = engine.core.features.pooling
        assert (pooling.mode, pooling.normalize) == ("last", True)
        np.testing.assert_allclose(engine.encode(SENTENCES[2])["embedding"],
                                   reference.encode(SENTENCES[2]), atol=1e-4)
    with Engine(path, is_embedding=True, pooler_config='{"pooling_type": "MEAN", '
                '"normalize": false}', **SMALL) as engine:
        np.testing.assert_allclose(engine.encode(SENTENCES[2])["embedding"], tokens.mean(0),
                                   atol=1e-4)
    with pytest.raises(ValueError, match="--pooler-config: this server generates text"):
        Engine(path, pooler_config='{"pooling_type": "CLS"}', **SMALL)
    with pytest.raises(ValueError, match="only pooling_type and normalize"):
        Engine(path, is_embedding=True, pooler_config='{"softmax": true}', **SMALL)
