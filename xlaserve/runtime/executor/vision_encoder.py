"""VisionEncoder: a vision model's tower (model/vision/qwen_vision.py) run over images, precompiled
per patch bucket, its output cached by image (issue 55).

Each call packs as many waiting images as fit the largest bucket into one run of the tower
(the images' attention kept apart by their segments: model/vision/vision_inputs.encoder_batch),
padded to the smallest bucket that holds them: powers of two from MIN_PATCHES up to the largest
image's patches (`max_patches`, from the processor's max_pixels), each compiled at start-up, so
no image compiles while serving. An image's rows are kept by its hash (the processed pixels')
in a least-recently-used cache of `cache_tokens` decoder tokens: a conversation that sends an
image again, or a request's `n` choices, run the tower once.

Called from worker threads (the HTTP layer prepares a request's images off the event loop, and
several requests at once): a lock keeps the cache and the device calls in order.
"""
from __future__ import annotations

import collections
import logging
import threading

import jax
import numpy as np
from flax import nnx

from xlaserve.model.vision.vision_inputs import encoder_batch
from xlaserve.runtime.executor.buckets import pow2_buckets

logger = logging.getLogger(__name__)

MIN_PATCHES = 64  # the smallest bucket: a 112 x 112 image (Qwen's 14-pixel patches)


class VisionEncoder:
    def __init__(self, loaded, kernels, max_patches: int, cache_tokens: int = 16384):
        """`loaded`: the LoadedModel (its `model.vision`, as the runner packed it); `kernels`:
        the runner's; `max_patches`: the most patches an image may have."""
        self.config = loaded.config.vision
        self.dtype = loaded.dtype
        unit = self.config.merge_unit
        self.max_patches = max_patches - max_patches % unit
        if self.max_patches < unit:
            raise ValueError(f"images of {max_patches} patches are too small to encode")
        # Powers of two (multiples of the merge unit) and the largest, rounded down to one.
        self.buckets = pow2_buckets(min(MIN_PATCHES, self.max_patches), self.max_patches)
        graphdef, self._state = nnx.split(loaded.model.vision)

        self._encode = jax.jit(tower_program(graphdef, kernels))
        self._programs: dict[int, object] = {}
        self._cache = ImageRowCache(cache_tokens)
        self._lock = threading.Lock()
        self.runs = 0  # tower runs (tests count them: a cached image runs none)

    def precompile(self) -> None:
        """Every bucket's program, before serving."""
        for patches in self.buckets:
            args = device_args(idle_batch(self.config, patches))
            self._programs[patches] = self._encode.lower(self._state, args).compile()
        logger.info("Compiled the vision tower for %d patch buckets (up to %d patches an image)",
                    len(self.buckets), self.max_patches)

    def embed(self, images: list[tuple[str, np.ndarray, tuple[int, int, int]]]) -> list[np.ndarray]:
        """Each image's decoder rows [levels, image_tokens, out_hidden_size] (the model dtype:
        the embeddings, then Qwen3-VL's DeepStack rows), for
        `images` as (hash, pixel_values [patches, patch_dim], grid (t, h, w))."""
        for _, pixels, grid in images:
            if pixels.shape[0] > self.max_patches:
                raise ValueError(f"an image of {pixels.shape[0]} patches is over the "
                                 f"{self.max_patches} the vision tower was compiled for")
        with self._lock:
            found = self._cache.found([key for key, _, _ in images])
            todo = list({key: (key, p, g) for key, p, g in images if key not in found}.values())
            while todo:
                group, patches = [], 0
                while todo and patches + todo[0][1].shape[0] <= self.max_patches:
                    patches += todo[0][1].shape[0]
                    group.append(todo.pop(0))
                for (key, _, _), rows in zip(group, self._run(group, patches)):
                    found[key] = rows
                    self._cache.remember(key, rows)
        return [found[key] for key, _, _ in images]

    def _run(self, group, patches: int) -> list[np.ndarray]:
        bucket = next(b for b in self.buckets if b >= patches)
        batch = encoder_batch(self.config, [p for _, p, _ in group], [g for _, _, g in group],
                              bucket)
        program = self._programs.get(bucket)
        if program is None:
            program = self._encode
            if self._programs:  # precompiled, but not this bucket
                logger.warning("COMPILED WHILE SERVING: the vision tower for %d patches was not "
                               "precompiled; every request waited for it", bucket)
        merged = np.asarray(program(self._state, device_args(batch)))
        self.runs += 1
        return [rows.astype(self.dtype) for rows in batch.split(merged)]



class ImageRowCache:
    """Images' decoder rows [levels, tokens, hidden] by the image's hash, the least recently
    used dropped past `tokens` decoder tokens in all (both encoders': this file's and
    siglip_encoder.py's). Its caller holds a lock."""

    def __init__(self, tokens: int):
        self.tokens = tokens
        self._rows: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._cached_tokens = 0

    def found(self, keys: list[str]) -> dict[str, np.ndarray]:
        """The rows of those of `keys` held, each now the most recently used."""
        found = {key: self._rows[key] for key in keys if key in self._rows}
        for key in found:
            self._rows.move_to_end(key)
        return found

    def remember(self, key: str, rows: np.ndarray) -> None:
        self._rows[key] = rows
        self._cached_tokens += rows.shape[1]
        while self._cached_tokens > self.tokens and len(self._rows) > 1:
            _, dropped = self._rows.popitem(last=False)
            self._cached_tokens -= dropped.shape[1]


def idle_batch(config, patches: int):
    """The tower's inputs for a bucket of `patches` holding one blank merged token: what its
    program is compiled with (here and for other hardware, aot.vision_tower_compiled)."""
    grid = (1, config.spatial_merge_size, config.spatial_merge_size)
    return encoder_batch(config, [np.zeros((config.merge_unit, config.patch_dim), np.float32)],
                         [grid], patches)


def tower_program(graphdef, kernels):
    """The tower's run as a pure function of its state and `device_args`: what is jitted here
    and compiled for other hardware (aot.vision_tower_compiled)."""

    def encode(state, batch):
        tower = nnx.merge(graphdef, state)
        return tower(batch["patches"], batch["cos"], batch["sin"], batch["cu_windows"],
                     batch["num_windows"], batch["cu_images"], batch["num_images"],
                     batch["pos_index"], batch["pos_weight"], kernels)

    return encode


def device_args(batch) -> dict:
    """The tower's arguments of an EncoderBatch (model/vision/vision_inputs.py)."""
    return {"patches": batch.patches, "cos": batch.cos, "sin": batch.sin,
            "cu_windows": batch.cu_windows, "num_windows": batch.num_windows,
            "cu_images": batch.cu_images, "num_images": batch.num_images,
            "pos_index": batch.pos_index, "pos_weight": batch.pos_weight}
