"""A vision model's request images -> its prompt ids and PromptImages (issue 55).

The chat template writes one placeholder token (`image_token_id`, `<|image_pad|>`) per image;
`ImagePrompts.prepare` runs the checkpoint's image processor (transformers' Qwen2-VL processor:
resized to whole 28-pixel squares between min_pixels and max_pixels, normalized, cut in patches),
the vision tower (runtime/executor/vision_encoder.py: once per image, cached by its pixels'
hash), expands each placeholder to the image's tokens, and computes the prompt's multimodal
RoPE positions (model/vision/vision_inputs.mrope_positions). Called off the event loop (it decodes
pixels and waits for the device); nothing here touches the engine's loop state.
"""
from __future__ import annotations

import hashlib
import logging

import numpy as np

from xlaserve.model.vision.vision_inputs import mrope_positions
from xlaserve.runtime.executor.forward_batch import ForwardBatch
from xlaserve.runtime.executor.image_rows import PromptImages, add_image_rows
from xlaserve.runtime.executor.vision_encoder import VisionEncoder

logger = logging.getLogger(__name__)

# transformers' Qwen2-VL processor's default max_pixels (12845056) makes an image of up to
# 16384 decoder tokens, whose tower run (65536 patches, full attention in 4 of Qwen2.5-VL's
# 32 blocks) is more than a server should precompile by default; vLLM's Qwen2.5-VL recipes cap
# it at 1280 x 28 x 28. --mm-processor-kwargs '{"max_pixels": N}' sets it.
DEFAULT_MAX_PIXELS = 1280 * 28 * 28


class ImagePrompts:
    def __init__(self, vision_config, processor, encoder: VisionEncoder, max_images: int,
                 hidden_size: int, dtype):
        """`hidden_size`, `dtype`: the decoder's, of the rows a step takes."""
        self.config = vision_config
        self.processor = processor
        self.encoder = encoder
        self.max_images = max_images  # per request (--limit-mm-per-prompt)
        self.hidden_size, self.dtype = hidden_size, dtype

    def forward_batch(self, batch: ForwardBatch, scheduled) -> ForwardBatch:
        """The step hook (steps.py): the batch with its images' rows and multimodal RoPE
        positions (executor/image_rows.py)."""
        return add_image_rows(batch, [r.prompt_images for r in scheduled.requests],
                                   self.hidden_size, self.dtype)

    def placeholders(self, prompt_ids: list[int], images: list, placeholder: int,
                     name: str) -> list[int]:
        """Where the prompt's image placeholders (`placeholder`, called `name` in a refusal)
        are; ValueError where they are not one per image or the images are over the limit."""
        places = [i for i, token in enumerate(prompt_ids) if token == placeholder]
        if len(places) != len(images):
            raise ValueError(f"the prompt has {len(places)} image placeholders{name} for "
                             f"{len(images)} images")
        if len(images) > self.max_images:
            raise ValueError(f"{len(images)} images are over the {self.max_images} a request may "
                             "have (--limit-mm-per-prompt)")
        return places

    def prepare(self, prompt_ids: list[int], images: list) -> tuple[list[int],
                                                                  PromptImages | None]:
        """(the prompt's ids with each image's placeholder expanded, its PromptImages) for
        `images` (PIL images, in the prompt's order); (prompt_ids, None) without images.
        ValueError where the placeholders and the images do not match."""
        image_id = self.config.image_token_id
        places = self.placeholders(prompt_ids, images, image_id, "")
        if not images:
            return prompt_ids, None
        processed = self.processor(images=images, return_tensors="np")
        grids = [tuple(int(n) for n in g) for g in processed["image_grid_thw"]]
        sizes = [t * h * w for t, h, w in grids]
        pixels = np.split(np.asarray(processed["pixel_values"], np.float32),
                          np.cumsum(sizes)[:-1])
        keys = [hashlib.sha256(np.asarray(g, np.int64).tobytes() + p.tobytes()).hexdigest()
                for p, g in zip(pixels, grids)]
        rows = self.encoder.embed(list(zip(keys, pixels, grids)))
        ids, embed_rows, cache_key, start, row = [], [], [], 0, 0
        for place, key, image_rows in zip(places, keys, rows):
            text = prompt_ids[start:place]
            count = image_rows.shape[1]
            ids += text + [image_id] * count
            embed_rows += [-1] * len(text) + list(range(row, row + count))
            # Negative: never a token id; one value per image, from its hash.
            cache_key += text + [-1 - int(key[:15], 16)] * count
            row, start = row + count, place + 1
        tail = prompt_ids[start:]
        ids, embed_rows, cache_key = ids + tail, embed_rows + [-1] * len(tail), cache_key + tail
        positions, delta = mrope_positions(self.config, ids, grids)
        return ids, PromptImages(embeds=np.concatenate(rows, axis=1),
                                     embed_rows=np.asarray(embed_rows, np.int32),
                                     positions=positions, rope_delta=delta, cache_key=cache_key)


def images_per_prompt(image_data, num_prompts: int, batched: bool) -> list[list]:
    """SGLang's `image_data` as a list of images per prompt: for a batch, one entry per prompt
    (an image, a list of them, or None); for one prompt, an image or a list. ValueError where a
    batch's entries do not match its prompts."""
    per_prompt = image_data if batched else [image_data]
    if not isinstance(per_prompt, list) or len(per_prompt) != num_prompts:
        raise ValueError(f"image_data needs one entry (an image or a list) per prompt, "
                         f"{num_prompts}")
    return [[] if images is None else images if isinstance(images, list) else [images]
            for images in per_prompt]


def read_image(item):
    """An offline caller's image (SGLang's Engine `image_data`: a PIL image, its bytes, a file
    path or a data: URL) as an RGB PIL image."""
    import base64
    import io

    from PIL import Image

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, str) and item.startswith("data:"):
        item = base64.b64decode(item.partition(",")[2])
    if isinstance(item, (bytes, bytearray)):
        item = io.BytesIO(item)
    elif not isinstance(item, str):
        raise ValueError(f"an image is a PIL image, bytes, a file path or a data: URL, not "
                         f"{type(item).__name__}")
    with Image.open(item) as image:
        return image.convert("RGB")


def image_processor(model_path: str, kwargs: dict | None):
    """The checkpoint's image processor (its preprocessor_config.json) as transformers' Qwen2-VL
    processor in NumPy and PIL (no torchvision), with --mm-processor-kwargs' min_pixels and
    max_pixels (max_pixels DEFAULT_MAX_PIXELS unless given)."""
    from transformers import Qwen2VLImageProcessorPil

    kwargs = dict(kwargs or {})  # checked: image_flags.processor_kwargs
    processor = Qwen2VLImageProcessorPil.from_pretrained(model_path, **kwargs)
    if "max_pixels" not in kwargs and max_pixels(processor) > DEFAULT_MAX_PIXELS:
        logger.info("Images are resized to at most %d pixels (the checkpoint's processor: %d; "
                    "--mm-processor-kwargs '{\"max_pixels\": N}' to change)", DEFAULT_MAX_PIXELS,
                    max_pixels(processor))
        processor = Qwen2VLImageProcessorPil.from_pretrained(
            model_path, **{**kwargs, "max_pixels": DEFAULT_MAX_PIXELS})
    return processor


def max_pixels(processor) -> int:
    """The processor's max_pixels (transformers keeps it as size.longest_edge)."""
    return int(processor.size.longest_edge)


def max_patches(processor, vision_config) -> int:
    """The most patches an image has after the processor's resize (max_pixels, in whole squares
    of the merged patch)."""
    return max_pixels(processor) // vision_config.patch_size ** 2
