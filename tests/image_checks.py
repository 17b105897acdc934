"""The checks the Gemma image tests share (tests/vision/test_gemma3_images.py,
test_gemma4_images.py, tests/http/test_gemma3_vision_server.py, test_gemma4_vision_server.py),
beside tests/vision_models.py's chat turn and step-by-step prefill logits: batched greedy
requests with their images, prompts sharing an image through the prefix cache, an Engine on
two CPU devices (a process of its own), and an OpenAI SDK chat with a base64 image."""
import base64
import io
import json
import os
import subprocess
import sys

import numpy as np

from tests.vision_models import chat

NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def ids_of(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


def check_batched_with_images(engine, hf_model, directory, hf_generate, prompts):
    """Every (text, images) prompt submitted together gives transformers' greedy tokens and
    their logprobs (2e-4), with nothing compiled while serving (steps, tower)."""
    core = engine.core
    expanded = [core.features.images.prepare(ids_of(engine, t), i)[0] for t, i in prompts]
    expected = [hf_generate(hf_model, directory, ids, images, NEW_TOKENS, logprobs=True)
                for ids, (_, images) in zip(expanded, prompts)]
    compiled, tower = core.runner.compile_count(), core.features.images.encoder._encode
    results = engine.generate([t for t, _ in prompts], dict(GREEDY),
                              image_data=[list(i) or None for _, i in prompts],
                              return_logprob=True)
    assert [r["output_ids"] for r in results] == [t for t, _ in expected]
    np.testing.assert_allclose(
        [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in results],
        [lp for _, lp in expected], atol=2e-4)
    assert core.runner.compile_count() == compiled and tower._cache_size() == 0


def check_shared_image_prefix(engine, hf_model, directory, hf_generate, image, text: str,
                              short: str, page_size: int = 4):
    """`text` (a chat with `image`) twice: the second reuses its whole pages, the image's
    included. `short` (its start, its reusable pages ending inside the image) starts at the
    page before the image and computes the image again, whole. The image runs the tower once;
    every answer is transformers'."""
    engine.core.flush_cache()
    images = engine.core.features.images
    runs = images.encoder.runs
    ids, prompt_images = images.prepare(ids_of(engine, text), [image])
    first, end = prompt_images.whole_spans[0]
    short_ids = images.prepare(ids_of(engine, short), [image])[0]
    reusable = (len(short_ids) - 1) // page_size * page_size
    assert short_ids == ids[:len(short_ids)] and first < reusable < end
    outs = [engine.generate(t, dict(GREEDY), image_data=image) for t in (text, text, short)]
    assert images.encoder.runs == runs + 1  # one image, encoded once
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert cached == [0, (len(ids) - 1) // page_size * page_size,
                      first // page_size * page_size]
    for out, prompt in zip(outs, (ids, ids, short_ids)):
        assert out["output_ids"] == hf_generate(hf_model, directory, prompt, [image], NEW_TOKENS)


TENSOR_PARALLEL = """
import json, sys
from PIL import Image
from xlaserve.offline import Engine
directory, image, options, text = sys.argv[1:]
with Engine(directory, tp_size=2, **json.loads(options)) as engine:
    compiled = engine.core.runner.compile_count()
    out = engine.generate(text, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                          image_data=Image.open(image).convert("RGB"))
    assert engine.core.runner.compile_count() == compiled, "compiled while serving"
print(json.dumps(out["output_ids"]))
"""


def check_two_devices(engine, hf_model, directory, hf_generate, image, options: dict,
                      tmp_path):
    """A chat with `image` through an Engine(directory, tp_size=2, **options) on two CPU
    devices, in a process of its own, gives transformers' greedy tokens; nothing compiled while
    serving."""
    text = chat(engine, "what is in this picture", "<image>", "describe it")
    ids, _ = engine.core.features.images.prepare(ids_of(engine, text), [image])
    image.save(tmp_path / "image.png")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL, directory,
                           str(tmp_path / "image.png"), json.dumps(options), text], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == hf_generate(
        hf_model, directory, ids, [image], NEW_TOKENS)


def chat_with_image(server, model_name: str, image, hf_generate, hf_model, directory):
    """An OpenAI SDK chat with `image` (base64) between two text parts, answered with
    transformers' greedy tokens (`hf_generate`'s for the prompt as the server expands it);
    (the response, the prompt's ids, its PromptImages)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "what is in this picture"},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "describe it"}]}]
    tokenizer = server.ctx.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"} if p["type"] == "image_url" else p
                                      for p in messages[0]["content"]]}],
        tokenize=False, add_generation_prompt=True)
    ids, prompt_images = server.ctx.core.features.images.prepare(
        tokenizer.encode(text, add_special_tokens=False), [image])
    expected = hf_generate(hf_model, directory, ids, [image], NEW_TOKENS)
    out = server.openai().chat.completions.create(
        model=model_name, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    words = tokenizer.decode(expected, skip_special_tokens=True).split()
    assert out.choices[0].message.content.split() == words and words
    assert out.usage.prompt_tokens == len(ids)
    return out, ids, prompt_images
