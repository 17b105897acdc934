"""Tiny random vision-language checkpoints for the tests of issue 55: Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and Qwen3.5, dense and MoE (2 decoder layers of width 64, Qwen3.5's 4; a 2-block vision
tower of width 32), a word-level tokenizer with Qwen's chat and vision markers, a Qwen-VL-style chat template,
and an image processor whose max_pixels keeps images to at most 64 patches."""
import numpy as np

from tests.tiny_models import HYBRID

WORDS = ["what", "is", "in", "this", "picture", "and", "that", "one", "describe", "it",
         "user", "assistant", "system", "a", "red", "cat"]
MARKERS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
           "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_word_tokenizer(directory, vocabulary: dict, special: list, chat_template: str,
                        **names):
    """A word-level tokenizer of `vocabulary` (word -> id) saved to `directory`: words between
    spaces, a run of newlines one token (Gemma's and Llama 4's vocabularies have them), the
    `special` markers whole, `chat_template`; `names`: PreTrainedTokenizerFast's (bos_token,
    eos_token, ...). Gemma 3's and Llama 4's image tests' (gemma3_images.py, llama4_images.py)."""
    import tokenizers
    import transformers
    from tokenizers import Regex, pre_tokenizers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(" "), "removed"), pre_tokenizers.Split(Regex("\n+"),
                                                                          "isolated")])
    tokenizer.decoder = tokenizers.decoders.WordPiece()  # words joined by spaces
    tokenizer.add_special_tokens([tokenizers.AddedToken(marker, special=True)
                                  for marker in special])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]",
                                                **names)
    fast.chat_template = chat_template
    fast.save_pretrained(directory)


def make_tiny_vision_language(directory, kind: str = "qwen2_5_vl", seed: int = 0):
    """Saves the checkpoint, tokenizer and processor to `directory`; returns transformers'
    model (float32, eval). Every weight is random, norms around 1."""
    import tokenizers
    import torch
    import transformers

    # The markers are words of the vocabulary too, so that their ids are known here.
    vocabulary = {word: i for i, word in enumerate(["[UNK]", "[PAD]"] + WORDS + MARKERS)}
    ids = {marker: vocabulary[marker] for marker in MARKERS}
    # The model's vocabulary is the tokenizer's: every output token is a word of it.
    text = dict(vocab_size=len(vocabulary), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]},
                bos_token_id=None, eos_token_id=ids["<|im_end|>"])
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"])
    if kind == "qwen2_5_vl":
        # 56-pixel windows: 2 x 2 merged tokens, so an image of up to 4 x 4 has several.
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                      out_hidden_size=64, fullatt_block_indexes=[1], window_size=56)
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    elif kind == "qwen3_vl":
        # 16-pixel patches, a 4 x 4 grid of learned positions, DeepStack from both blocks; the
        # decoder a Qwen3 (q/k norms) with interleaved multimodal RoPE.
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                      out_hidden_size=64, patch_size=16, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1])
        text.update(head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
            "mrope_interleaved": True})
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen3VLForConditionalGeneration
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        # Qwen3-VL's tower without DeepStack; the decoder tiny_models.HYBRID[kind]'s (three
        # Gated DeltaNet layers, then a gated full one; Qwen3.5-MoE's MLPs experts) with RoPE on
        # a quarter of each head: 8 of 32 rows, 4 pairs, split [2, 1, 1] and interleaved.
        vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                      out_hidden_size=64, patch_size=16, num_position_embeddings=16)
        spec = {k: v for k, v in HYBRID[kind].items() if k not in ("cls", "architecture")}
        for name in spec.pop("absent", ()):
            text.pop(name)
        text.update(spec, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        prefix = "Qwen3_5" if kind == "qwen3_5" else "Qwen3_5Moe"
        config = getattr(transformers, prefix + "Config")(text_config=text, vision_config=vision,
                                                          **tokens)
        model_class = getattr(transformers, prefix + "ForConditionalGeneration")
    else:
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class = transformers.Qwen2VLForConditionalGeneration
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.copy_((1.0 + 0.2 * torch.randn_like(param)) if name.endswith("weight")
                            else 0.1 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(0.5 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    model.save_pretrained(directory)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece()  # words joined by spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", eos_token="<|im_end|>",
        additional_special_tokens=MARKERS)
    assert [fast.convert_tokens_to_ids(m) for m in MARKERS] == [ids[m] for m in MARKERS]
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    # At most 64 patches (16 tokens) an image: of 14 pixels, or Qwen3-VL's and Qwen3.5's 16.
    square = 32 if kind in ("qwen3_vl", "qwen3_5", "qwen3_5_moe") else 28
    transformers.Qwen2VLImageProcessorPil(
        min_pixels=square * square, max_pixels=square * square * 16,
        patch_size=square // 2).save_pretrained(directory)
    return model


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_generate(model, directory, prompt_ids: list[int], images: list, max_new_tokens: int,
                logprobs: bool = False):
    """transformers' greedy tokens for a prompt whose image placeholders are expanded already
    (`ImagePrompts.prepare`'s ids), its `images` processed by the checkpoint's processor;
    `logprobs`: (tokens, each token's log-probability under its logits)."""
    import transformers

    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(directory)
    kwargs = {}
    if images:
        out = processor(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    image_id = model.config.image_token_id
    return hf_greedy_with(model, prompt_ids, max_new_tokens, logprobs, mm_token_type_ids=[
        int(t == image_id) for t in prompt_ids], **kwargs)


def our_logits(loaded, ids, prompt_images, chunk_ends, page_size=4):
    """Every position's logits of `ids` (a prompt with images, `prompt_images` its
    PromptImages), prefilled in the chunks `chunk_ends` cut it into, on one sequence's pages
    (Gemma 3's and Llama 4's image tests)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from xlaserve.runtime.executor.buckets import buckets_for_limits, pow2_buckets
    from xlaserve.runtime.executor.forward_batch import make_forward_batch
    from xlaserve.runtime.executor.image_rows import add_image_rows
    from xlaserve.runtime.executor.kernels import kernels_for
    from xlaserve.runtime.executor.kv_pool import init_kv_pool
    from xlaserve.runtime.scheduler.request import SeqChunk

    model, config = loaded.model, loaded.config
    pages = -(-len(ids) // page_size)
    kv_caches = init_kv_pool(config, pages + 1, page_size, loaded.dtype, loaded.mesh)
    kernels = kernels_for("auto", loaded.mesh)
    graphdef, state = nnx.split(model)
    buckets = buckets_for_limits(len(ids), 1, pages, token_paddings=pow2_buckets(1, 128))

    @jax.jit
    def forward(state, caches, ids, positions, metadata, embeds):
        lm = nnx.merge(graphdef, state)
        hidden, caches = lm.hidden_states(ids, positions, caches, metadata, kernels,
                                          input_embeds=embeds)
        return lm.logits(hidden, kernels), caches

    logits, start = [], 0
    for end in chunk_ends:
        batch = make_forward_batch([SeqChunk(ids[start:end], start, list(range(1, pages + 1)))],
                                   buckets, page_size)
        batch = add_image_rows(batch, [prompt_images], config.hidden_size, loaded.dtype)
        embeds = batch.input_embeds
        if embeds is None:
            embeds = np.zeros((1, len(batch.input_ids), config.hidden_size), loaded.dtype)
        out, kv_caches = forward(state, kv_caches, jnp.asarray(batch.input_ids),
                                 jnp.asarray(batch.positions), batch.host_metadata(),
                                 jnp.asarray(embeds))
        logits.append(np.asarray(out)[:end - start])
        start = end
    return np.concatenate(logits)


def chat(engine, *parts) -> str:
    """A user turn of text and images ("<image>") through the engine's chat template."""
    content = [{"type": "image"} if p == "<image>" else {"type": "text", "text": p}
               for p in parts]
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                tokenize=False, add_generation_prompt=True)


def generate_all(engine, prompts, params: dict):
    """Tokens and logprobs of every (text, images) prompt, submitted together."""
    results = engine.generate([t for t, _ in prompts], dict(params),
                              image_data=[list(i) or None for _, i in prompts],
                              return_logprob=True)
    return ([r["output_ids"] for r in results],
            [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in results])


TWO_DEVICES = """
import json, sys
from PIL import Image
from xlaserve.offline import Engine
directory, image, options, text = sys.argv[1:]
with Engine(directory, tp_size=2, **json.loads(options)) as engine:
    out = engine.generate(text, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                          image_data=Image.open(image).convert("RGB"))
print(json.dumps(out["output_ids"]))
"""


def two_device_tokens(directory, image, options: dict, text: str, tmp_path) -> list[int]:
    """8 greedy tokens of `text` with `image` from an Engine of `options` at --tp-size 2 over
    two CPU devices (a process of its own: the device count is set before JAX starts)."""
    import json
    import os
    import subprocess
    import sys

    image.save(tmp_path / "image.png")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", TWO_DEVICES, directory,
                           str(tmp_path / "image.png"), json.dumps(options), text], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def image_chat(image, before: str, after: str) -> tuple[list, list]:
    """(OpenAI chat messages of one user turn: `before`, `image` as a base64 PNG data: URL,
    `after`; the same turn's messages as the chat template reads them, the image a part)."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "text", "text": before}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": after}]
    templated = [{"type": "image"} if p["type"] == "image_url" else p for p in parts]
    return [{"role": "user", "content": parts}], [{"role": "user", "content": templated}]


def hf_greedy_with(model, prompt_ids: list[int], max_new_tokens: int, logprobs: bool,
                   **inputs):
    """transformers' greedy tokens for `prompt_ids` and the model's other `inputs` (lists
    become a batch of one; tensors pass as they are); `logprobs`: and each token's
    log-probability under its logits."""
    import torch

    inputs = {k: torch.tensor([v]) if isinstance(v, list) else v for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                  dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True, **inputs)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    if not logprobs:
        return tokens
    chosen = [torch.log_softmax(step[0].float(), -1)[token].item()
              for step, token in zip(out.logits, tokens)]
    return tokens, chosen
