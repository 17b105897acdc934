"""A tiny random Llama 4 with images for the tests: tests/tiny_models.make_tiny_llama4_conditional
(a 2-layer encoder on 32-pixel tiles, 16 tokens a tile; the text model's attention chunk of 32),
a word-level tokenizer with Llama 4's markers at their roles, a Llama-4-style chat template, and
a preprocessor_config.json of up to 4 tiles. And the oracle: transformers' processor, logits
and greedy tokens for a prompt and its images.

transformers' Llama4ImageProcessor runs on torchvision only, which the test environment lacks
(torch is there: the oracle's models). `hf_image_processor` runs transformers' own processor
code with four torchvision functions stood in by torch: resize = torch's antialiased bilinear
interpolate on uint8 (the kernel torchvision's resize calls for uint8 images on AVX2 CPUs), pad,
normalize (torchvision's formula, in the tensor's dtype) and grayscale_to_rgb (RGB in, as is).
"""
import sys
import types

import numpy as np

from tests.tiny_models import make_tiny_llama4_conditional
from tests.vision_models import save_word_tokenizer

TILE, TILE_TOKENS, MAX_TILES = 32, 16, 4
WORDS = ["user", "assistant", "what", "is", "in", "this", "picture", "and", "that", "one",
         "describe", "it", "a", "red", "cat"]
SPECIAL = {"[UNK]": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2, "<|eot|>": 3,
           "<|header_start|>": 4, "<|header_end|>": 5, "<|finetune_right_pad|>": 6,
           "<|tile_x_separator|>": 494, "<|tile_y_separator|>": 495, "<|image|>": 496,
           "<|image_start|>": 497, "<|image_end|>": 498, "<|patch|>": 499}
NEWLINES = {"\n" * n: 200 + n for n in range(1, 5)}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|header_start|>{{ message['role'] }}"
    "<|header_end|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|image|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|eot|>{% endfor %}{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>"
    "\n\n{% endif %}")


def make_tiny_llama4_images(directory, seed: int = 0):
    """Saves the checkpoint, tokenizer and image processor config to `directory`; returns
    transformers' model (float32, eval)."""
    import json
    import os

    model = make_tiny_llama4_conditional(directory, seed)
    vocabulary = {**SPECIAL, **NEWLINES, **{word: 10 + i for i, word in enumerate(WORDS)}}
    # Every id the model may say a word ("w300"): its text is transformers' tokens, word by word.
    vocabulary.update({f"w{i}": i for i in sorted(set(range(512)) - set(vocabulary.values()))})
    save_word_tokenizer(directory, vocabulary, [m for m in SPECIAL if m != "[UNK]"],
                        CHAT_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot|>",
                        pad_token="<|finetune_right_pad|>")
    # Scout's preprocessor_config.json at the tiny tile size and 4 tiles at most.
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Llama4ImageProcessorFast", "do_resize": True,
                   "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                   "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
                   "rescale_factor": 1 / 255, "max_patches": MAX_TILES,
                   "resize_to_max_canvas": False, "size": {"height": TILE, "width": TILE},
                   "processor_class": "Llama4Processor"}, f)
    return model


def hf_image_processor(**kwargs):
    """transformers' Llama4ImageProcessor (the checkpoint's settings, `kwargs` over them) with
    the torchvision functions it calls stood in by torch's (the module docstring)."""
    import torch
    import transformers.image_processing_backends as backends
    from transformers.image_utils import PILImageResampling
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached False before the stand-in is importable
    functional = types.SimpleNamespace()

    class InterpolationMode:
        BILINEAR, LANCZOS = "bilinear", "lanczos"

    def resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
        assert interpolation == InterpolationMode.BILINEAR and image.dtype == torch.uint8
        if tuple(image.shape[-2:]) == tuple(int(s) for s in size):
            return image
        return torch.nn.functional.interpolate(image, size=[int(s) for s in size],
                                               mode="bilinear", align_corners=False,
                                               antialias=antialias)

    def pad(image, padding, fill=0, padding_mode="constant"):
        left, top, right, bottom = (int(p) for p in padding)
        assert set(fill if isinstance(fill, list) else [fill]) == {0}
        return torch.nn.functional.pad(image, (left, right, top, bottom))

    def normalize(image, mean, std, inplace=False):
        mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return image.sub(mean).div_(std)

    functional.__dict__.update(InterpolationMode=InterpolationMode, resize=resize, pad=pad,
                               normalize=normalize, grayscale_to_rgb=lambda image: image)
    backends.tvF = functional
    backends.pil_torch_interpolation_mapping = {PILImageResampling.BILINEAR:
                                                InterpolationMode.BILINEAR}
    name = "transformers.models.llama4.image_processing_llama4"
    if name not in sys.modules:
        stand_ins = {"torchvision": types.ModuleType("torchvision"),
                     "torchvision.transforms": types.ModuleType("torchvision.transforms"),
                     "torchvision.transforms.v2": types.ModuleType("torchvision.transforms.v2")}
        stand_ins["torchvision.transforms.v2"].functional = functional
        sys.modules.update(stand_ins)
        try:
            __import__(name)
        finally:
            for module in stand_ins:
                del sys.modules[module]
    settings = dict(size={"height": TILE, "width": TILE}, max_patches=MAX_TILES)
    return sys.modules[name].Llama4ImageProcessor(**{**settings, **kwargs})


def hf_processor(directory):
    """transformers' Llama4Processor of the checkpoint (its tokenizer, hf_image_processor): the
    text's <|image|> expanded as transformers expands it, and the images' pixels."""
    import transformers

    return transformers.Llama4Processor(
        image_processor=hf_image_processor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(directory), patch_size=4,
        pixel_shuffle_ratio=0.5)


def hf_image_embeds(model, ids, images, pixels=None):
    """transformers' input embeddings of `ids` (expanded already) with `images`' features in
    the <|patch|> rows: what Llama4ForConditionalGeneration.forward hands its language model
    (its own forward then fails in transformers 5.24, reading `image_outputs` from the text
    model's output). `pixels` [tiles, 3, S, S]: the images' tiles as given (ours), else
    transformers' processor's."""
    import torch

    embeds = model.get_input_embeddings()(torch.tensor([ids]))
    if images:
        if pixels is None:
            pixels = hf_image_processor()(images=images, return_tensors="pt")["pixel_values"]
        features = model.vision_model(pixels.to(model.dtype)).last_hidden_state
        projected = model.multi_modal_projector(features.reshape(-1, features.shape[-1]))
        mask = (torch.tensor([ids]) == model.config.image_token_id)[..., None]
        embeds = embeds.masked_scatter(mask, projected.to(embeds.dtype))
    return embeds


def hf_logits(model, ids, images, pixels=None) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model.language_model(inputs_embeds=hf_image_embeds(model, ids, images, pixels))
    return out.logits[0].float().numpy()


def hf_generate(model, ids, images, max_new_tokens: int, logprobs: bool = False, pixels=None):
    """transformers' greedy tokens after a prompt whose images are expanded already (each step
    the whole sequence again: no cache to get wrong); `logprobs`: (tokens, each one's
    log-probability under its logits); `pixels`: as hf_image_embeds takes them."""
    import torch

    tokens, chosen = [], []
    with torch.no_grad():
        prompt = hf_image_embeds(model, ids, images, pixels)
        for _ in range(max_new_tokens):
            more = model.get_input_embeddings()(torch.tensor([tokens], dtype=torch.long))
            logits = model.language_model(inputs_embeds=torch.cat([prompt, more], 1)).logits
            last = torch.log_softmax(logits[0, -1].float(), -1)
            tokens.append(int(last.argmax()))
            chosen.append(float(last[tokens[-1]]))
    return (tokens, chosen) if logprobs else tokens


def smooth_image(height: int, width: int, seed: int = 0):
    """An RGB image of slow waves (a photograph's smoothness, where random noise is the worst
    case of the resizes' differences: model/vision/llama4_tiles.py)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows, columns = np.mgrid[0:height, 0:width].astype(np.float32)
    planes = [np.sin(rows / rng.uniform(3, 9) + rng.uniform(0, 6)) *
              np.cos(columns / rng.uniform(3, 9) + rng.uniform(0, 6)) for _ in range(3)]
    return Image.fromarray((np.stack(planes, -1) * 100 + 128).astype(np.uint8))

