"""Images in chat completions (issue 55), through the OpenAI SDK on a tiny random Qwen2.5-VL:
a base64 image (and two, streamed) answered with transformers' greedy tokens, the image tokens
counted in usage; every refusal a 400 naming the part (bad base64, not an image, too many, a
private or local URL, an unknown detail); a text model refuses image parts."""
import base64
import io

import httpx
import pytest

from tests.http.conftest import RunningServer
from tests.vision_models import hf_generate, make_tiny_vision_language, random_image

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-vl"))
    model = make_tiny_vision_language(directory, "qwen2_5_vl")
    running = RunningServer(directory, served_model_name="tiny-vl", page_size=4,
                            chunked_prefill_size=8, max_prefill_tokens=16, context_length=256,
                            limit_mm_per_prompt='{"image": 2}', enable_metrics=True)
    yield running, model, directory
    running.close()


def _data_url(image, kind: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _expected(server, model, directory, messages, images,
              to_eos: bool = False) -> tuple[str, int]:
    """(transformers' greedy text, the prompt's tokens) for chat `messages` with `images`;
    `to_eos`: up to its first end of turn (a request that cannot ignore EOS)."""
    ctx = server.ctx
    text = ctx.tokenizer.apply_chat_template(
        [{"role": m["role"], "content": [{"type": "image"} if p["type"] == "image_url" else p
                                          for p in m["content"]]} for m in messages],
        tokenize=False, add_generation_prompt=True)
    ids, _ = ctx.core.features.images.prepare(ctx.tokenizer.encode(text, add_special_tokens=False),
                                     images)
    tokens = hf_generate(model, directory, ids, images, NEW_TOKENS)
    end = ctx.tokenizer.convert_tokens_to_ids("<|im_end|>")
    if to_eos and end in tokens:
        tokens = tokens[:tokens.index(end)]
    return _words(ctx.tokenizer.decode(tokens, skip_special_tokens=True)), len(ids)


def _words(text: str) -> str:
    """The words of a text: the tokenizer's vocabulary is words (a stream's first piece keeps
    its space)."""
    return " ".join(text.split())


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny-vl", messages=messages,
                                          max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True}, **kwargs)


def test_a_base64_image_is_answered_with_transformers_tokens(vision):
    server, model, directory = vision
    image = random_image(100, 140, 11)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture"},
        {"type": "image_url", "image_url": {"url": _data_url(image), "detail": "high"}}]}]
    text, prompt_tokens = _expected(server, model, directory, messages, [image])
    out = _chat(server.openai(), messages)
    assert _words(out.choices[0].message.content) == text and text
    assert out.usage.prompt_tokens == prompt_tokens > 16  # the image's tokens counted


def test_two_images_streamed_and_a_jpeg(vision):
    server, model, directory = vision
    first, second = random_image(60, 90, 12), random_image(120, 60, 13)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(first)}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": _data_url(second)}}]}]
    text, _ = _expected(server, model, directory, messages, [first, second])
    stream = _chat(server.openai(), messages, stream=True)
    assert _words("".join(c.choices[0].delta.content or "" for c in stream if c.choices)) == text
    jpeg = _data_url(first, "JPEG")  # decoded as the server decodes it: compare by the SDK
    out = _chat(server.openai(), [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": jpeg}}]}])
    assert out.choices[0].finish_reason == "length"


def _refusal(server, part, param_suffix="") -> dict:
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-vl", "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "what"}, part]}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url" + param_suffix
    return error


def test_bad_images_are_400s_naming_the_part(vision):
    server, _, _ = vision
    assert "base64" in _refusal(server, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64,@@@"}})["message"]
    assert "decoded" in _refusal(server, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"not an image").decode()}})["message"]
    assert "data:image" in _refusal(server, {"type": "image_url", "image_url": {
        "url": "data:text/plain;base64,aGk="}})["message"]
    assert "detail" in _refusal(server, {"type": "image_url", "image_url": {
        "url": _data_url(random_image(30, 30)), "detail": "ultra"}}, ".detail")["message"]
    assert "public" in _refusal(server, {"type": "image_url", "image_url": {
        "url": server.base_url + "/health"}})["message"]  # 127.0.0.1: never fetched
    assert "allowed-local-media-path" in _refusal(server, {"type": "image_url", "image_url": {
        "url": "file:///etc/passwd"}})["message"]
    assert "image_url.url" in _refusal(server, {"type": "image_url"})["message"]


def test_more_images_than_the_limit_are_refused_before_any_is_read(vision):
    server, _, _ = vision
    image = {"type": "image_url", "image_url": {"url": _data_url(random_image(30, 30))}}
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-vl", "max_tokens": 2,
        "messages": [{"role": "user", "content": [image, image, image]}]})
    assert response.status_code == 400
    assert "--limit-mm-per-prompt" in response.json()["error"]["message"]


def test_a_placeholder_typed_as_text_does_not_pass_for_an_image(vision):
    server, _, _ = vision
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-vl", "max_tokens": 2,
        "messages": [{"role": "user", "content": "<|image_pad|> what"}]})
    assert response.status_code == 400
    assert "placeholder" in response.json()["error"]["message"]


def test_sglang_generate_takes_image_data(vision):
    """SGLang's native /generate: the prompt holds the placeholders, image_data the images (a
    data: URL, or bare base64 as SGLang takes it)."""
    server, model, directory = vision
    image = random_image(80, 100, 17)
    text = "<|vision_start|> <|image_pad|> <|vision_end|> describe it"
    ids, _ = server.ctx.core.features.images.prepare(server.ctx.tokenizer.encode(text), [image])
    expected = hf_generate(model, directory, ids, [image], NEW_TOKENS)
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    for data in (_data_url(image), _data_url(image).split(",", 1)[1]):
        out = httpx.post(server.base_url + "/generate", timeout=60, json={
            "text": text, "image_data": data, "sampling_params": params}).json()
        assert out["output_ids"] == expected and out["meta_info"]["prompt_tokens"] == len(ids)
    response = httpx.post(server.base_url + "/generate", timeout=60, json={
        "text": "describe it", "image_data": [_data_url(image)], "sampling_params": params})
    assert response.status_code == 400 and response.json()["error"]["param"] == "image_data"


def test_tokenize_refuses_image_parts_it_cannot_count(vision):
    server, _, _ = vision
    response = httpx.post(server.base_url + "/tokenize", timeout=60, json={
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(random_image(30, 30))}}]}]})
    assert response.status_code == 400 and "tokenize" in response.json()["error"]["message"]


def test_a_text_only_chat_still_works_on_the_vision_server(vision):
    server, model, directory = vision
    messages = [{"role": "user", "content": [{"type": "text", "text": "describe a red cat"}]}]
    text, _ = _expected(server, model, directory, messages, [])
    assert _words(_chat(server.openai(), messages).choices[0].message.content) == text


def test_the_responses_api_takes_input_image(vision):
    server, model, directory = vision
    image = random_image(80, 80, 14)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture"},
        {"type": "image_url", "image_url": {"url": _data_url(image)}}]}]
    text, prompt_tokens = _expected(server, model, directory, messages, [image], to_eos=True)
    out = server.openai().responses.create(
        model="tiny-vl", max_output_tokens=NEW_TOKENS, temperature=0,
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": "what is in this picture"},
            {"type": "input_image", "image_url": _data_url(image), "detail": "low"}]}])
    assert _words(out.output_text) == text and out.usage.input_tokens == prompt_tokens
    assert out.usage.output_tokens > 1  # the comparison is of some text


def test_a_batch_line_with_an_image(vision, tmp_path):
    from tests.http.test_batches import results, upload, wait

    server, model, directory = vision
    image = random_image(64, 96, 15)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(image)}},
        {"type": "text", "text": "describe it"}]}]
    text, _ = _expected(server, model, directory, messages, [image])
    client = server.openai()
    lines = [{"custom_id": "image", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny-vl", "messages": messages, "max_tokens": NEW_TOKENS,
                       "temperature": 0, "ignore_eos": True}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": [
                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]}}]
    batch = client.batches.create(input_file_id=upload(client, tmp_path, lines).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait(client, batch)
    assert batch.status == "completed" and batch.request_counts.failed == 1, batch
    body = results(client, batch.output_file_id)["image"]["response"]["body"]
    assert _words(body["choices"][0]["message"]["content"]) == text


def test_qwen3_vl_answers_an_image_through_the_sdk(tmp_path):
    """Qwen3-VL (DeepStack, interleaved multimodal RoPE, learned positions) on the same route."""
    directory = str(tmp_path / "qwen3-vl")
    model = make_tiny_vision_language(directory, "qwen3_vl")
    server = RunningServer(directory, served_model_name="tiny-vl", page_size=4,
                           chunked_prefill_size=8, max_prefill_tokens=16, context_length=256)
    try:
        image = random_image(90, 120, 16)
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(image)}},
            {"type": "text", "text": "what is in this picture"}]}]
        text, prompt_tokens = _expected(server, model, directory, messages, [image])
        out = _chat(server.openai(), messages)
        assert _words(out.choices[0].message.content) == text and text
        assert out.usage.prompt_tokens == prompt_tokens
    finally:
        server.close()


@pytest.fixture
def image_site(tmp_path):
    """A local HTTP server with an image, redirects and a file over the byte bound."""
    import http.server
    import threading

    image = random_image(70, 70, 18)
    image.save(tmp_path / "cat.png")
    (tmp_path / "big.png").write_bytes(b"\0" * (3 * 2**20))

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def do_GET(self):
            if self.path.startswith("/moved.png"):  # to /cat.png, or to ?to=URL
                target = self.path.partition("?to=")[2] or "/cat.png"
                self.send_response(302)
                self.send_header("Location", target)
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}", image
    site.shutdown()


def test_an_image_url_is_fetched_through_public_redirects_and_bounded(vision, image_site,
                                                                     monkeypatch):
    """http(s) URLs: fetched (this test lets the server fetch from 127.0.0.1, which it refuses
    otherwise: test_bad_images_are_400s_naming_the_part), redirects followed where they lead to
    a public host (here: not to `localhost`), the body bounded by --max-image-bytes (20 MiB; the
    fixture's file is 3 MiB, so a smaller bound is set here)."""
    from xlaserve.http import images

    async def only_127(host, param):
        if host != "127.0.0.1":
            raise images.bad_request(f"the image URL's host {host!r} is not a public address",
                                     param)

    monkeypatch.setattr(images, "check_public_host", only_127)
    server, model, directory = vision
    base, image = image_site
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": base + "/cat.png"}},
        {"type": "text", "text": "what is in this picture"}]}]
    text, _ = _expected(server, model, directory, messages, [image])
    assert _words(_chat(server.openai(), messages).choices[0].message.content) == text
    messages[0]["content"][0]["image_url"]["url"] = base + "/moved.png"  # -> /cat.png
    assert _words(_chat(server.openai(), messages).choices[0].message.content) == text
    private = base.replace("127.0.0.1", "localhost") + "/cat.png"
    error = _refusal(server, {"type": "image_url", "image_url": {
        "url": base + "/moved.png?to=" + private}})
    assert "'localhost' is not a public address" in error["message"]
    monkeypatch.setattr(server.ctx.core.args, "max_image_bytes", 2**20)
    error = _refusal(server, {"type": "image_url", "image_url": {"url": base + "/big.png"}})
    assert "--max-image-bytes" in error["message"]
