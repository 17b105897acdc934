"""Rerank and score (issue 54): a cross-encoder server (bge-reranker's XLMRobertaForSequenceClassification,
an ms-marco MiniLM's BertForSequenceClassification with its pair's token types) answers
/v1/rerank (SGLang's list), /rerank and /v2/rerank (vLLM's Jina / Cohere shape) and /score with
sentence-transformers' CrossEncoder scores and order; an embedding server scores by cosine
similarity; bad input is a 400 naming the field."""
import numpy as np
import pytest

from tests.embedding_models import save_cross_encoder, save_decoder_embedding
from tests.http.conftest import RunningServer
from tests.http.test_embeddings_server import _post

pytest.importorskip("sentence_transformers")

QUERY = "the cat sat"
DOCUMENTS = ["a dog ran on the mat", "the cat sat on a mat", "dog", "mat mat the cat ran"]
SMALL = dict(page_size=4, max_prefill_tokens=32, context_length=24)


@pytest.fixture(scope="module", params=["xlm-roberta", "bert"])
def reranker(request, tmp_path_factory):
    path, reference = save_cross_encoder(tmp_path_factory.mktemp(request.param), request.param)
    running = RunningServer(path, served_model_name="tiny-rerank", **SMALL)  # --runner auto
    yield running, reference
    running.close()


def test_sglang_rerank_is_the_cross_encoders_scores_sorted(reranker):
    server, reference = reranker
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    assert len(set(np.round(expected, 3))) == len(DOCUMENTS)  # distinct: the order means something
    out = _post(server, "/v1/rerank", query=QUERY, documents=DOCUMENTS).json()
    assert [r["index"] for r in out] == list(np.argsort(-expected))
    for r in out:
        assert r["score"] == pytest.approx(float(expected[r["index"]]), abs=1e-5)
        assert r["document"] == DOCUMENTS[r["index"]]
    top = _post(server, "/v1/rerank", query=QUERY, documents=DOCUMENTS, top_n=2,
                return_documents=False).json()
    assert [r["index"] for r in top] == [r["index"] for r in out[:2]]
    assert all("document" not in r for r in top)


def test_jina_cohere_shape_and_vllm_score(reranker):
    server, reference = reranker
    expected = reference.predict([(QUERY, d) for d in DOCUMENTS])
    for route in ("/rerank", "/v2/rerank"):
        out = _post(server, route, model="tiny-rerank", query=QUERY, documents=DOCUMENTS,
                    top_n=3).json()
        assert out["model"] == "tiny-rerank" and out["usage"]["total_tokens"] > 0
        assert [r["index"] for r in out["results"]] == list(np.argsort(-expected))[:3]
        first = out["results"][0]
        assert first["document"] == {"text": DOCUMENTS[first["index"]]}
        assert first["relevance_score"] == pytest.approx(float(expected.max()), abs=1e-5)
    scored = _post(server, "/score", text_1=QUERY, text_2=DOCUMENTS).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-5)
    pairwise = _post(server, "/v1/score", text_1=[QUERY, "dog"], text_2=DOCUMENTS[:2]).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               reference.predict([(QUERY, DOCUMENTS[0]), ("dog", DOCUMENTS[1])]),
                               atol=1e-5)


@pytest.mark.parametrize("route,body,param", [
    ("/v1/rerank", {"query": "cat", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "cat", "documents": ["dog"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": "cat " * 30, "documents": ["dog"]}, "documents"),
    ("/v1/rerank", {"query": "cat", "documents": ["dog"] * 10_000}, "documents"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/embeddings", {"input": "cat"}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None)])
def test_bad_input_is_a_400(reranker, route, body, param):
    server, _ = reranker
    response = _post(server, route, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_embedding_model_scores_by_cosine_similarity(tmp_path):
    path, reference = save_decoder_embedding(tmp_path, "mean")
    server = RunningServer(path, **SMALL)
    try:
        vectors = reference.encode([QUERY] + DOCUMENTS)  # normalised: cosine is the dot
        out = _post(server, "/score", text_1=QUERY, text_2=DOCUMENTS).json()
        np.testing.assert_allclose([d["score"] for d in out["data"]], vectors[1:] @ vectors[0],
                                   atol=1e-4)
        ranked = _post(server, "/v1/rerank", query=QUERY, documents=DOCUMENTS).json()
        assert [r["index"] for r in ranked] == list(np.argsort(-(vectors[1:] @ vectors[0])))
    finally:
        server.close()


def _yes_probability(model, tokenizer, ids) -> float:
    """Qwen3-Reranker's score by its model card: softmax over the last token's no / yes logits."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    return float(torch.softmax(logits[[no, yes]], 0)[1])


@pytest.mark.parametrize("template", [None, "qwen3-reranker"])
def test_a_decoder_reranker_scores_by_its_yes_no_logits(tmp_path, template):
    """Qwen3-Reranker served as vLLM serves it (--hf-overrides classifier_from_token) equals
    transformers' P(yes) at the pair's last token: without a template the query's tokens then
    the document's (vLLM); with the model card's template (`instruct` or its default)."""
    import transformers

    from xlaserve.http.parsing.chat_template import BUILTIN_TEMPLATES
    from tests.embedding_models import QWEN3_RERANKER, make_tiny_reranker

    path, model = make_tiny_reranker(tmp_path / "reranker")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    server = RunningServer(path, hf_overrides=QWEN3_RERANKER, chat_template=template, page_size=4,
                           max_prefill_tokens=32, chunked_prefill_size=8, context_length=128)
    try:
        for instruct in ([None] if template is None else [None, "find the cat"]):
            body = {"query": QUERY, "documents": DOCUMENTS}
            if instruct is not None:
                body["instruct"] = instruct
            ranked = _post(server, "/v1/rerank", **body).json()
            expected = []
            for document in DOCUMENTS:
                if template is None:
                    ids = tokenizer(QUERY, document)["input_ids"]
                else:
                    text = tokenizer.apply_chat_template(
                        [{"role": "user", "content": QUERY}, {"role": "user", "content": document}],
                        chat_template=BUILTIN_TEMPLATES[template], tokenize=False,
                        **({} if instruct is None else {"instruct": instruct}))
                    ids = tokenizer.encode(text, add_special_tokens=False)
                expected.append(_yes_probability(model, tokenizer, ids))
            assert len(set(np.round(expected, 3))) == len(DOCUMENTS)  # an order to get right
            assert [r["index"] for r in ranked] == list(np.argsort(-np.array(expected)))
            got = {r["index"]: r["score"] for r in ranked}
            np.testing.assert_allclose([got[i] for i in range(len(DOCUMENTS))], expected,
                                       atol=1e-4)
        if template is None:  # no template to put an instruction in
            refused = _post(server, "/v1/rerank", query=QUERY, documents=DOCUMENTS,
                            instruct="x")
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "instruct"
    finally:
        server.close()
