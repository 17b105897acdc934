"""Classify and reward models (issue 73): a decoder reward model (Qwen3ForSequenceClassification,
one label), a decoder classifier (LlamaForSequenceClassification, three named labels) and an
encoder classifier (BertForSequenceClassification, three labels) served with no flag: /classify
(vLLM's and SGLang's shapes), SGLang's native reward body, /encode, `Engine.encode` and /pooling
equal transformers' logits through the checkpoint's activation; bad input is a 400 naming the
field."""
import numpy as np
import pytest

from tests.embedding_models import make_tiny_encoder, save_decoder_classifier
from tests.http.conftest import RunningServer
from tests.http.fuzz_support import hypothesis_home  # noqa: F401 - a fixture: its caches' folder
from tests.http.test_embeddings_server import _post

TEXTS = ["the cat sat on a mat", "dog ran", "a mat", "the dog sat on the cat"]
SMALL = dict(page_size=4, max_prefill_tokens=32, chunked_prefill_size=8, context_length=40)
LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


def _logits(model, tokenizer, text: str, **encode) -> np.ndarray:
    import torch

    ids = tokenizer(text, return_tensors="pt", **encode)
    with torch.no_grad():
        return model(**ids).logits[0].numpy()


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    import transformers

    path, model = save_decoder_classifier(tmp_path_factory.mktemp("reward"),
                                          "Qwen3ForSequenceClassification", labels=1)
    server = RunningServer(path, served_model_name="tiny-reward", **SMALL)  # no flag: it pools
    yield server, model, transformers.AutoTokenizer.from_pretrained(path)
    server.close()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    import transformers

    path, model = save_decoder_classifier(tmp_path_factory.mktemp("classifier"),
                                          "LlamaForSequenceClassification", labels=3,
                                          id2label=LABELS)
    server = RunningServer(path, **SMALL)
    yield server, model, transformers.AutoTokenizer.from_pretrained(path)
    server.close()


def test_a_reward_models_score_is_its_logit_in_sglangs_and_vllms_shapes(reward):
    """SGLang's native /classify and /encode answer the raw score; vLLM's /classify its sigmoid
    (one label), and the raw logit with use_activation false."""
    server, model, tokenizer = reward
    expected = np.array([_logits(model, tokenizer, t)[0] for t in TEXTS])
    assert len(set(np.round(expected, 2))) == len(TEXTS)  # distinct: a wrong row shows
    native = _post(server, "/classify", text=TEXTS).json()
    np.testing.assert_allclose([o["embedding"][0] for o in native], expected, rtol=1e-4,
                               atol=1e-4)
    assert native[0]["meta_info"]["prompt_tokens"] == len(TEXTS[0].split())
    one = _post(server, "/encode", input_ids=tokenizer.encode(TEXTS[1])).json()
    assert one["embedding"] == pytest.approx([expected[1]], rel=1e-4, abs=1e-4)
    offline = server.ctx.engine.encode(TEXTS[3])  # the Engine that serves: SGLang's encode
    assert offline["embedding"] == pytest.approx([expected[3]], rel=1e-4, abs=1e-4)
    out = _post(server, "/v1/classify", model="tiny-reward", input=TEXTS).json()
    assert out["object"] == "list" and out["model"] == "tiny-reward"
    assert out["id"].startswith("classify-") and out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == sum(len(t.split()) for t in TEXTS)
    np.testing.assert_allclose([d["probs"][0] for d in out["data"]], 1 / (1 + np.exp(-expected)),
                               rtol=1e-4, atol=1e-5)
    assert {(d["label"], d["num_classes"]) for d in out["data"]} == {("LABEL_0", 1)}
    raw = _post(server, "/classify", input=TEXTS[2], use_activation=False).json()
    assert raw["data"][0]["probs"] == pytest.approx([expected[2]], rel=1e-4, abs=1e-4)


def test_a_classifiers_labels_and_probabilities_equal_transformers(classifier):
    server, model, tokenizer = classifier
    expected = np.stack([_logits(model, tokenizer, t) for t in TEXTS])
    out = _post(server, "/classify", input=TEXTS).json()
    assert [d["index"] for d in out["data"]] == [0, 1, 2, 3]
    for row, d in zip(expected, out["data"]):
        np.testing.assert_allclose(d["probs"], _softmax(row), rtol=1e-4, atol=1e-5)
        assert d["label"] == LABELS[str(int(np.argmax(row)))] and d["num_classes"] == 3
    assert len({d["label"] for d in out["data"]}) > 1  # the labels differ: argmax means something
    by_ids = _post(server, "/v1/classify", input=[tokenizer.encode(t) for t in TEXTS[:2]],
                   activation=False).json()
    np.testing.assert_allclose([d["probs"] for d in by_ids["data"]], expected[:2], rtol=1e-4,
                               atol=1e-4)
    pooled = _post(server, "/pooling", input=TEXTS[3]).json()
    assert pooled["data"][0]["object"] == "pooling"
    np.testing.assert_allclose(pooled["data"][0]["data"], _softmax(expected[3]), rtol=1e-4,
                               atol=1e-5)


def test_chat_messages_are_classified_as_the_chat_template_renders_them(classifier):
    server, model, tokenizer = classifier
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    expected = _logits(model, tokenizer, text, add_special_tokens=False)
    out = _post(server, "/classify", messages=messages).json()
    np.testing.assert_allclose(out["data"][0]["probs"], _softmax(expected), rtol=1e-4, atol=1e-5)
    assert out["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("route,body,param", [
    ("/classify", {"input": []}, "input"),
    ("/classify", {"input": "cat", "messages": [{"role": "user", "content": "cat"}]}, "input"),
    ("/classify", {"input": "cat", "text": "cat"}, "input"),
    ("/v1/classify", {"text": "cat"}, "text"),
    ("/classify", {"input": "cat", "use_activation": True, "softmax": False}, "use_activation"),
    ("/classify", {"input": "cat " * 50}, "input"),
    ("/classify", {"input": [[10_000]]}, "input"),
    ("/classify", {"input": ["cat"] * 10_000}, "input"),
    ("/classify", {"input": "cat", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/pooling", {"input": "cat", "dimensions": 2}, "dimensions"),
    ("/v1/rerank", {"query": "cat", "documents": ["dog"]}, "documents"),
    ("/v1/embeddings", {"input": "cat"}, None),
    ("/v1/completions", {"prompt": "cat"}, None)])
def test_bad_input_is_a_400_naming_the_field(classifier, route, body, param):
    server, _, _ = classifier
    response = _post(server, route, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_encoder_classifiers_labels_equal_transformers(tmp_path):
    """BertForSequenceClassification of three labels, multi-label: a sigmoid per label."""
    import json

    import transformers

    path = make_tiny_encoder(tmp_path / "bert", "bert", classifier=True, labels=3)
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    config["problem_type"] = "multi_label_classification"
    (tmp_path / "bert" / "config.json").write_text(json.dumps(config))
    model = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    server = RunningServer(path, page_size=4, max_prefill_tokens=32, context_length=24)
    try:
        expected = np.stack([_logits(model, tokenizer, t) for t in TEXTS])
        out = _post(server, "/classify", input=TEXTS).json()
        np.testing.assert_allclose([d["probs"] for d in out["data"]], 1 / (1 + np.exp(-expected)),
                                   rtol=1e-4, atol=1e-5)
        assert [d["label"] for d in out["data"]] == [f"LABEL_{i}" for i in expected.argmax(1)]
    finally:
        server.close()


def test_an_embedding_model_has_no_classify_but_pools(tmp_path):
    from tests.embedding_models import save_decoder_embedding

    path, reference = save_decoder_embedding(tmp_path, "mean")
    server = RunningServer(path, **SMALL)
    try:
        refused = _post(server, "/classify", input="the cat")
        assert refused.status_code == 400 and "classifier head" in refused.json()["error"]["message"]
        pooled = _post(server, "/pooling", input=["the cat", "dog"]).json()
        np.testing.assert_allclose([d["data"] for d in pooled["data"]],
                                   reference.encode(["the cat", "dog"]), atol=1e-5)
    finally:
        server.close()


def test_a_classifier_refuses_to_generate_pooler_config_and_a_misshapen_head(tmp_path):
    from xlaserve.launch_server import make_context
    from xlaserve.server_args import ServerArgs

    path, _ = save_decoder_classifier(tmp_path, "Qwen3ForSequenceClassification", labels=1)
    with pytest.raises(ValueError, match="no LM head to generate with"):
        make_context(ServerArgs(model_path=path, runner="generate", **SMALL))
    with pytest.raises(ValueError, match="--pooler-config"):
        make_context(ServerArgs(model_path=path, pooler_config='{"pooling_type": "MEAN"}',
                                **SMALL))
    # A score head whose rows are not the model's width stops the load, naming the tensor.
    import glob

    from safetensors.numpy import load_file, save_file

    (weights,) = glob.glob(path + "/*.safetensors")
    tensors = load_file(weights)
    tensors["score.weight"] = tensors["score.weight"][:, :8].copy()
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"score.weight has shape \[1, 8\]"):
        make_context(ServerArgs(model_path=path, **SMALL))


def test_classify_and_pooling_fuzz(classifier):
    """Random JSON values in one to three fields of valid /classify and /pooling bodies (as
    test_fuzz.py does to the generation routes): never a 5xx, a 4xx naming a field."""
    from hypothesis import given, settings

    from tests.http.fuzz_support import FUZZ, fields, fresh_connections, post_json
    from tests.http.fuzz_values import mutated
    from xlaserve.http.pooling.classify import ClassifyRequest

    server, _, _ = classifier
    bases = [{"input": TEXTS[:2]}, {"messages": [{"role": "user", "content": "the cat"}]},
             {"text": "dog ran"}, {"input": [[1, 2]], "use_activation": False,
                                   "encoding_format": "base64"}]
    paths = fields(ClassifyRequest) + [("messages", 0, "content"), ("input", 0)]
    with fresh_connections(server.base_url) as http:
        for route in ("/classify", "/pooling"):
            @settings(FUZZ, max_examples=120)
            @given(mutated(bases, paths))
            def fuzz(body):
                post_json(http, route, body)

            fuzz()
        assert http.post("/classify", json={"input": "cat"}).status_code == 200
