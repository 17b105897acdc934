"""/v1/embeddings and /encode on an embedding server (issue 54), through the OpenAI SDK: a
decoder embedding checkpoint as Qwen3-Embedding ships answers sentence-transformers' vectors for
texts and token ids, as floats and base64, Matryoshka widths where the checkpoint has them;
bad input is a 400 naming the field; a generation server refuses embeddings and an embedding
server refuses generations."""
import base64
import json

import httpx
import numpy as np
import pytest

from tests.embedding_models import save_decoder_embedding
from tests.http.conftest import RunningServer

pytest.importorskip("sentence_transformers")

SENTENCES = ["the cat sat on a mat", "dog", "a dog ran on the mat the mat the cat sat on a dog"]


@pytest.fixture(scope="module")
def embedding(tmp_path_factory):
    path, reference = save_decoder_embedding(tmp_path_factory.mktemp("embedding"), "mean")
    config_path = f"{path}/config.json"
    config = json.load(open(config_path))
    config["matryoshka_dimensions"] = [16, 32]
    json.dump(config, open(config_path, "w"))
    # Prompt pieces of 4 tokens: the longer sentences run in several steps.
    running = RunningServer(path, is_embedding=True, served_model_name="tiny-embed",
                            page_size=4, chunked_prefill_size=4, max_prefill_tokens=8,
                            context_length=32, enable_metrics=True)
    yield running, reference
    running.close()


def _post(server, route, **body):
    return httpx.post(server.base_url + route, json=body, timeout=60)


def test_openai_sdk_embeddings_equal_sentence_transformers(embedding):
    server, reference = embedding
    client = server.openai()
    expected = reference.encode(SENTENCES, convert_to_numpy=True)
    # The SDK asks for base64 and decodes it when no format is given.
    out = client.embeddings.create(model="tiny-embed", input=SENTENCES)
    got = np.array([d.embedding for d in out.data], np.float32)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == "tiny-embed"
    assert out.usage.prompt_tokens == out.usage.total_tokens == 6 + 1 + 14
    floats = client.embeddings.create(model="tiny-embed", input=SENTENCES[0],
                                      encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, expected[0], atol=1e-4)
    ids = server.ctx.tokenizer.encode(SENTENCES[2])
    by_ids = client.embeddings.create(model="tiny-embed", input=[ids, ids[:3]])
    np.testing.assert_allclose(by_ids.data[0].embedding, expected[2], atol=1e-4)
    np.testing.assert_allclose(by_ids.data[1].embedding, reference.encode("a dog ran"),
                               atol=1e-4)


def test_base64_is_the_little_endian_float32_bytes(embedding):
    server, reference = embedding
    body = _post(server, "/v1/embeddings", input="dog", encoding_format="base64").json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, reference.encode("dog"), atol=1e-4)


def test_matryoshka_dimensions_are_a_prefix_normalised_again(embedding):
    server, reference = embedding
    out = server.openai().embeddings.create(model="tiny-embed", input="the cat", dimensions=16)
    prefix = reference.encode("the cat")[:16]
    np.testing.assert_allclose(out.data[0].embedding, prefix / np.linalg.norm(prefix), atol=1e-4)
    refused = _post(server, "/v1/embeddings", input="the cat", dimensions=20)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    assert "16, 32" in refused.json()["error"]["message"]


def test_too_long_input_is_refused_or_truncated(embedding):
    server, reference = embedding
    words = "the cat sat on a mat " * 6  # 36 tokens, over the context of 32
    refused = _post(server, "/v1/embeddings", input=words)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert refused.json()["error"]["param"] == "input"
    kept = _post(server, "/v1/embeddings", input=words, truncate_prompt_tokens=5).json()
    np.testing.assert_allclose(kept["data"][0]["embedding"], reference.encode("cat sat on a mat"),
                               atol=1e-4)  # the last 5 tokens
    assert kept["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[]]}, "input"),
    ({"input": [10**6]}, "input"), ({"input": "dog", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "dog", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": ["dog"] * 10_000}, "input")])
def test_bad_input_is_a_400_naming_the_field(embedding, body, param):
    server, _ = embedding
    response = _post(server, "/v1/embeddings", **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_native_encode_and_generation_refused(embedding):
    server, reference = embedding
    one = _post(server, "/encode", text="the cat").json()
    np.testing.assert_allclose(one["embedding"], reference.encode("the cat"), atol=1e-4)
    assert one["meta_info"]["prompt_tokens"] == 2
    many = _post(server, "/encode", input_ids=[[1, 2], [3]]).json()
    assert len(many) == 2 and len(many[1]["embedding"]) == 64
    chat = _post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}])
    assert chat.status_code == 400 and "generates no text" in chat.json()["error"]["message"]
    completion = _post(server, "/v1/completions", prompt=[1, 2, 3], max_tokens=2)
    assert completion.status_code == 400


def test_a_generation_server_refuses_embeddings(server):
    response = _post(server, "/v1/embeddings", input="hello")
    assert response.status_code == 400
    assert "embedding model" in response.json()["error"]["message"]


def test_metrics_count_embedding_requests_and_their_tokens(embedding):
    server, _ = embedding

    def counted(name):
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    tokens, requests = counted("xlaserve:prompt_tokens"), counted("xlaserve:num_requests")
    _post(server, "/v1/embeddings", input=["the cat", "dog"])
    assert counted("xlaserve:prompt_tokens") == tokens + 3
    assert counted("xlaserve:num_requests") == requests + 2


def test_native_health_and_model_info_on_an_embedding_server(embedding):
    """SGLang's /get_model_info says is_generation false; /health_generate embeds instead."""
    server, _ = embedding
    info = httpx.get(server.base_url + "/get_model_info", timeout=10).json()
    assert info["is_generation"] is False
    assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200


def test_a_batch_of_embeddings_requests(embedding, tmp_path):
    """OpenAI's Batch API with endpoint /v1/embeddings: each line answered as the live route
    answers it (the vectors), a bad line failing alone."""
    from tests.http.test_batches import results, upload, wait

    server, reference = embedding
    client = server.openai()
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "tiny-embed", "input": text, "encoding_format": "float"}}
             for i, text in enumerate(SENTENCES)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                  "body": {"input": "dog", "dimensions": 20}})
    batch = client.batches.create(input_file_id=upload(client, tmp_path, lines).id,
                                  endpoint="/v1/embeddings", completion_window="24h")
    batch = wait(client, batch)
    assert batch.status == "completed" and batch.request_counts.failed == 1, batch
    by_id = results(client, batch.output_file_id)
    expected = reference.encode(SENTENCES)
    for i in range(len(SENTENCES)):
        body = by_id[f"line-{i}"]["response"]["body"]
        np.testing.assert_allclose(body["data"][0]["embedding"], expected[i], atol=1e-4)
    errors = client.files.content(batch.error_file_id).read().decode()
    assert "dimensions" in errors
