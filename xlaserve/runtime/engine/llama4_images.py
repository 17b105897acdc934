"""Llama 4's request images -> its prompt ids and PromptImages (Llama-4-Scout-17B-16E, Maverick).

Llama 4's chat template writes `<|image|>` where a message has an image, and transformers'
Llama4Processor replaces each with the image's tokens before tokenizing (_prompt_split_image):

    <|image_start|>
      (more than one tile) per row of tiles: per tile n <|patch|>, <|tile_x_separator|> between
      tiles, <|tile_y_separator|> after the row
    <|image|> n <|patch|> (the global tile, or the only one) <|image_end|>

n the tokens a tile becomes (Scout: 144). The prompt here is ids: each `<|image|>` becomes those
ids, the markers' from the tokenizer, as tokenizing the expanded text gives them. The image
processor is model/vision/llama4_tiles.TileProcessor as the checkpoint's preprocessor_config.json
sets it; the encoder's rows (runtime/executor/towers/llama4_encoder.py) take the <|patch|> rows in order,
a tile's rows after another's as the tiles come (the global one last). The image tokens attend
causally, as text does, so a prefill chunk may end inside an image and the prefix cache may
reuse part of one (its rows are the same wherever they start).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import numpy as np

from xlaserve.model.vision.llama4_tiles import TileProcessor
from xlaserve.runtime.engine.image_prompts import ImagePrompts
from xlaserve.runtime.executor.image_rows import PromptImages
from xlaserve.runtime.executor.towers.llama4_encoder import Llama4Encoder

logger = logging.getLogger(__name__)

PROCESSOR_FILE = "preprocessor_config.json"
BILINEAR = 2  # PIL's (and transformers' PILImageResampling) number for it
# --mm-processor-kwargs this server takes, and their types.
PROCESSOR_KWARGS = {"max_patches": int, "resize_to_max_canvas": bool}


@dataclasses.dataclass(frozen=True)
class ImageMarkers:
    """The ids of the tokens around an image's <|patch|> tokens (the tokenizer's)."""
    image: int  # <|image|>: the chat template's placeholder, and the global tile's opening
    start: int  # <|image_start|>
    end: int  # <|image_end|>
    patch: int  # <|patch|>: one per row of the encoder's output (the config's image_token_id)
    tile_x: int  # <|tile_x_separator|>
    tile_y: int  # <|tile_y_separator|>

    def expansion(self, grid: tuple[int, int], per_tile: int) -> list[int]:
        """An image of `grid` (rows, columns) tiles as transformers' processor writes it."""
        ids = [self.start]
        rows, columns = grid
        if rows * columns > 1:
            for _ in range(rows):
                for x in range(columns):
                    ids += [self.patch] * per_tile + ([self.tile_x] if x < columns - 1 else [])
                ids.append(self.tile_y)
        return ids + [self.image] + [self.patch] * per_tile + [self.end]


class Llama4ImagePrompts(ImagePrompts):
    def __init__(self, config, processor: TileProcessor, encoder: Llama4Encoder,
                 max_images: int, hidden_size: int, dtype, markers: ImageMarkers):
        super().__init__(config, processor, encoder, max_images, hidden_size, dtype)
        self.markers = markers

    def prepare(self, prompt_ids: list[int], images: list) -> tuple[list[int],
                                                                  PromptImages | None]:
        """(the prompt's ids with each `<|image|>` expanded, its PromptImages) for `images`
        (PIL images, in the prompt's order); (prompt_ids, None) without images. ValueError where
        the placeholders and the images do not match."""
        m = self.markers
        if m.patch in prompt_ids:
            raise ValueError("the prompt holds image tokens (<|patch|>): write one <|image|> per "
                             "image, which is expanded here")
        places = self.placeholders(prompt_ids, images, m.image, " (<|image|>)")
        if not images:
            return prompt_ids, None
        processed = [self.processor(image) for image in images]
        keys = [hashlib.sha256(np.asarray(grid, np.int64).tobytes() + tiles.tobytes()).hexdigest()
                for tiles, grid in processed]
        rows = self.encoder.embed([(key, tiles) for key, (tiles, _) in zip(keys, processed)])
        ids, owners, start = [], [], 0
        for n, (place, (_, grid)) in enumerate(zip(places, processed)):
            image = m.expansion(grid, self.config.tokens_per_tile)
            ids += prompt_ids[start:place] + image
            owners += [-1] * (place - start) + [n] * len(image)
            start = place + 1
        ids += prompt_ids[start:]
        owners += [-1] * (len(prompt_ids) - start)
        patches = np.asarray(ids) == m.patch
        embeds = np.concatenate(rows, axis=1)
        if int(patches.sum()) != embeds.shape[1]:  # the encoder and the expansion disagree
            raise RuntimeError(f"{int(patches.sum())} <|patch|> tokens for {embeds.shape[1]} "
                               "encoder rows")
        # Negative: never a token id; one value per image, from its hash.
        image_keys = np.array([-1 - int(key[:15], 16) for key in keys] + [0], np.int64)
        cache_key = np.where(patches, image_keys[np.asarray(owners)], ids)
        return ids, PromptImages(embeds=embeds,
                                 embed_rows=np.where(patches, np.cumsum(patches) - 1,
                                                     -1).astype(np.int32),
                                 positions=None, rope_delta=0, cache_key=cache_key.tolist())


def llama4_image_prompts(args, loaded, runner, tokenizer, model_dir: str, max_images: int
                         ) -> Llama4ImagePrompts | None:
    """The server's Llama4ImagePrompts, or ValueError naming what it cannot run: a processor
    config this server's TileProcessor does not build, --mm-processor-kwargs other than
    max_patches and resize_to_max_canvas, a tokenizer without Llama 4's image markers. None
    without a tokenizer (--skip-tokenizer-init): text is served, images refused per request."""
    config = loaded.config.vision
    if tokenizer is None:
        logger.warning("Llama 4 without its tokenizer (--skip-tokenizer-init): requests with "
                       "images are refused (an image's prompt needs its marker tokens)")
        return None
    processor = tile_processor(model_dir, config.image_size, args.mm_processor_kwargs)
    return Llama4ImagePrompts(config, processor,
                              Llama4Encoder(loaded, runner.kernels, processor.max_tiles()),
                              max_images, config.out_hidden_size, loaded.dtype,
                              image_markers(tokenizer, config.image_token_id))


def image_markers(tokenizer, patch_id: int) -> ImageMarkers:
    """The tokenizer's ids of Llama 4's image markers; ValueError naming one it lacks, or a
    <|patch|> other than the config's image_token_id (the rows the model replaces)."""
    vocabulary = tokenizer.get_vocab()
    names = dict(image="<|image|>", start="<|image_start|>", end="<|image_end|>",
                 patch="<|patch|>", tile_x="<|tile_x_separator|>",
                 tile_y="<|tile_y_separator|>")
    missing = [token for token in names.values() if token not in vocabulary]
    if missing:
        raise ValueError(f"Llama 4's images need the tokens {', '.join(missing)} in the "
                         "tokenizer's vocabulary")
    markers = ImageMarkers(**{field: vocabulary[token] for field, token in names.items()})
    if markers.patch != patch_id:
        raise ValueError(f"the tokenizer's <|patch|> is {markers.patch}, not the config's "
                         f"image_token_index {patch_id}")
    return markers


def tile_processor(model_dir: str, tile: int, kwargs_json: str | None) -> TileProcessor:
    """The checkpoint's preprocessor_config.json (transformers' defaults at the encoder's tile
    size without one) as a TileProcessor, --mm-processor-kwargs over it; ValueError for what
    TileProcessor does not build."""
    path = os.path.join(model_dir, PROCESSOR_FILE)
    settings = {}
    if os.path.exists(path):
        with open(path) as f:
            settings = json.load(f)
    else:
        logger.info("No %s: images tiled at %d pixels, normalized as transformers' Llama 4 "
                    "processor does by default", PROCESSOR_FILE, tile)
    kwargs = json.loads(kwargs_json) if kwargs_json else {}
    if not isinstance(kwargs, dict) or set(kwargs) - set(PROCESSOR_KWARGS) or any(
            type(value) is not PROCESSOR_KWARGS[key] for key, value in kwargs.items()):
        raise ValueError(f"--mm-processor-kwargs {kwargs_json}: Llama 4's images take "
                         "max_patches (an integer) and resize_to_max_canvas (true or false)")
    settings.update(kwargs)
    size = settings.get("size", {"height": tile, "width": tile})
    if (size.get("height"), size.get("width")) != (tile, tile):
        raise ValueError(f"the image processor's size {size} is not the vision encoder's "
                         f"{tile}-pixel square tile")
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if not settings.get(flag, True):
            raise ValueError(f"{flag} false: Llama 4's image processor is supported as "
                             "published (resized, rescaled and normalized)")
    if settings.get("resample", BILINEAR) != BILINEAR:
        raise ValueError(f"resample {settings['resample']}: Llama 4's images are resized "
                         f"bilinearly ({BILINEAR}) here")
    max_patches = settings.get("max_patches", 16)
    if max_patches < 1:
        raise ValueError(f"max_patches {max_patches}: an image has at least one tile")
    return TileProcessor(
        tile=tile, max_patches=max_patches,
        resize_to_max_canvas=bool(settings.get("resize_to_max_canvas", False)),
        rescale_factor=float(settings.get("rescale_factor", 1 / 255)),
        image_mean=tuple(settings.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(settings.get("image_std", (0.5, 0.5, 0.5))))
