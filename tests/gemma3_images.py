"""A tiny random Gemma 3 with images for the tests: tests/tiny_models.make_tiny_gemma3_conditional
with a 64-pixel SigLIP tower (8 x 8 patches of 8 pixels) pooled to 16 image tokens (2 x 2
squares), longer than the text model's sliding window (4) and than a 4-token page; a word-level
tokenizer with Gemma's markers at their roles and a token for each run of up to 8 newlines; a
Gemma-style chat template; transformers' Gemma3ImageProcessorPil at 64 pixels. And the oracle:
transformers' greedy tokens (and logits) for a prompt and its images."""
import numpy as np

from tests.tiny_models import make_tiny_gemma3_conditional
from tests.vision_models import hf_greedy_with, save_word_tokenizer

IMAGE_TOKENS = 16
WORDS = ["user", "model", "what", "is", "in", "this", "picture", "and", "that", "one",
         "describe", "it", "a", "red", "cat"]
SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "[UNK]": 3, "<start_of_turn>": 105,
           "<end_of_turn>": 106, "<start_of_image>": 497, "<end_of_image>": 498,
           "<image_soft_token>": 499}
NEWLINES = {"\n" * n: 200 + n for n in range(1, 9)}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def make_tiny_gemma3_images(directory, seed: int = 0):
    """Saves the checkpoint, tokenizer and image processor to `directory`; returns
    transformers' model (float32, eval)."""
    import transformers

    model = make_tiny_gemma3_conditional(directory, seed, vision=dict(image_size=64),
                                         mm_tokens_per_image=IMAGE_TOKENS)
    vocabulary = {**SPECIAL, **NEWLINES, **{word: 10 + i for i, word in enumerate(WORDS)}}
    save_word_tokenizer(
        directory, vocabulary, [marker for marker in SPECIAL if marker != "[UNK]"],
        CHAT_TEMPLATE, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(
        directory)
    return model


def hf_processor(directory):
    """transformers' Gemma3Processor of the checkpoint: the text's `<start_of_image>` expanded
    and its images' pixels, as transformers runs them."""
    import transformers

    return transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil.from_pretrained(directory),
        tokenizer=transformers.AutoTokenizer.from_pretrained(directory),
        image_seq_length=IMAGE_TOKENS)


def hf_generate(model, directory, prompt_ids: list[int], images: list, max_new_tokens: int,
                logprobs: bool = False):
    """transformers' greedy tokens for a prompt whose images are expanded already
    (`Gemma3ImagePrompts.prepare`'s ids, or transformers' processor's), its image tokens
    bidirectional within each image (token_type_ids); `logprobs`: (tokens, each one's
    log-probability under its logits)."""
    import transformers

    kwargs = {}
    if images:
        processor = transformers.Gemma3ImageProcessorPil.from_pretrained(directory)
        kwargs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
    image_id = model.config.image_token_id
    return hf_greedy_with(model, prompt_ids, max_new_tokens, logprobs, token_type_ids=[
        int(t == image_id) for t in prompt_ids], **kwargs)


def random_image(height: int, width: int, seed: int = 0):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
