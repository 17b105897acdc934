"""Llama4Encoder: Llama 4's vision encoder and projector (model/vision/llama4_vision.py) run over
images, one image's tiles a run, precompiled per tile-count bucket at start-up, the rows cached
by image.

An image is 1 tile, or up to max_patches tiles and the global one (Scout: 17 of 336 x 336
pixels); a run takes one image's tiles padded to the next bucket (powers of two up to the most
an image has: 1, 2, 4, 8, 16, 17), so no image compiles while serving. One Scout tile is 577
rows through 34 layers of width 1408 (~0.9 TFLOP), so an image fills a run on its own: runs are
not batched across images. An image's rows are kept by its tiles' hash
(vision_encoder.ImageRowCache): a conversation that sends an image again, or a request's `n`
choices, run the encoder once. Called from worker threads: a lock keeps the cache and the device
calls in order.
"""
from __future__ import annotations

import logging
import threading

import jax
import numpy as np
from flax import nnx

from xlaserve.runtime.executor.buckets import pow2_buckets
from xlaserve.runtime.executor.vision_encoder import ImageRowCache

logger = logging.getLogger(__name__)


class Llama4Encoder:
    def __init__(self, loaded, kernels, max_tiles: int, cache_tokens: int = 16384):
        """`loaded`: the LoadedModel (its `model.vision`, as the runner packed it); `kernels`:
        the runner's; `max_tiles`: the most tiles an image has (the processor's)."""
        self.config = loaded.config.vision
        self.dtype = loaded.dtype
        self.buckets = pow2_buckets(1, max_tiles)
        graphdef, self._state = nnx.split(loaded.model.vision)
        self._encode = jax.jit(tower_program(graphdef, kernels))
        self._programs: dict[int, object] = {}
        self._cache = ImageRowCache(cache_tokens)
        self._lock = threading.Lock()
        self.runs = 0  # encoder runs (tests count them: a cached image runs none)

    def precompile(self) -> None:
        """Every bucket's program, before serving."""
        for tiles in self.buckets:
            self._programs[tiles] = self._encode.lower(self._state,
                                                       idle_tiles(self.config, tiles)).compile()
        logger.info("Compiled the vision encoder for %d tile buckets (up to %d tiles an image)",
                    len(self.buckets), self.buckets[-1])

    def embed(self, images: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """Each image's decoder rows [1, tiles * tokens_per_tile, hidden] (the model dtype), its
        tiles' in order, for `images` as (hash, tiles [n, channels, image_size, image_size])."""
        shape = idle_tiles(self.config, 1).shape[1:]
        for _, tiles in images:
            if tiles.shape[1:] != shape or not 0 < tiles.shape[0] <= self.buckets[-1]:
                raise ValueError(f"an image of tiles {list(tiles.shape)}, not up to "
                                 f"{self.buckets[-1]} of {list(shape)} as the encoder takes")
        with self._lock:
            found = self._cache.found([key for key, _ in images])
            for key, tiles in images:
                if key not in found:
                    found[key] = self._run(tiles)
                    self._cache.remember(key, found[key])
        return [found[key] for key, _ in images]

    def _run(self, tiles: np.ndarray) -> np.ndarray:
        bucket = next(b for b in self.buckets if b >= tiles.shape[0])
        padded = idle_tiles(self.config, bucket)
        padded[:tiles.shape[0]] = tiles
        program = self._programs.get(bucket)
        if program is None:
            program = self._encode
            if self._programs:  # precompiled, but not this bucket
                logger.warning("COMPILED WHILE SERVING: the vision encoder for %d tiles was not "
                               "precompiled; every request waited for it", bucket)
        rows = np.asarray(program(self._state, padded))[:tiles.shape[0]]
        self.runs += 1
        return rows.reshape(1, -1, rows.shape[-1]).astype(self.dtype)


def idle_tiles(config, tiles: int) -> np.ndarray:
    """float32 [tiles, channels, image_size, image_size] of zeros: a bucket's input, what its
    program is compiled with (here and for other hardware, aot.vision_tower_compiled)."""
    return np.zeros((tiles, config.in_channels, config.image_size, config.image_size),
                    np.float32)


def tower_program(graphdef, kernels):
    """The encoder's run as a pure function of its state and tiles [n, C, S, S]."""

    def encode(state, tiles):
        return nnx.merge(graphdef, state)(tiles, kernels)

    return encode
