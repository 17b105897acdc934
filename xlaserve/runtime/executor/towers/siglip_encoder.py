"""SiglipEncoder: Gemma 3's tower and projector (model/vision/siglip_vision.py) run over images,
one image a run, precompiled at start-up, the rows cached by image.

Every image is the tower's one size (the processor resizes it to image_size square), so one
program serves them all: gemma-3's image is 4096 patches through 27 layers of width 1152
(~5 TFLOP: its matmuls' 3.3 and attention's 2), which fills a run on its own, so runs are not batched. An image's rows are kept
by its processed pixels' hash (vision_encoder.ImageRowCache): a conversation that sends an
image again, or a request's `n` choices, run the tower once. Called from worker threads: a lock
keeps the cache and the device calls in order.
"""
from __future__ import annotations

import logging
import threading

import jax
import numpy as np
from flax import nnx

from xlaserve.runtime.executor.vision_encoder import ImageRowCache

logger = logging.getLogger(__name__)


class SiglipEncoder:
    """Gemma 4's (gemma4_encoder.py) is this with its own program, checks and runs."""

    def __init__(self, loaded, kernels, cache_tokens: int = 16384):
        """`loaded`: the LoadedModel (its `model.vision`, as the runner packed it); `kernels`:
        the runner's."""
        self.config = loaded.config.vision
        self.dtype = loaded.dtype
        graphdef, self._state = nnx.split(loaded.model.vision)
        self._encode = jax.jit(self.program(graphdef, kernels))
        self._program = None
        self._cache = ImageRowCache(cache_tokens)
        self._lock = threading.Lock()
        self.runs = 0  # tower runs (tests count them: a cached image runs none)

    def precompile(self) -> None:
        """The one image's program, before serving."""
        self._program = self._encode.lower(self._state, idle_pixels(self.config)).compile()
        logger.info("Compiled the vision tower (one %d-pixel image a run)", self.config.image_size)

    def embed(self, images: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """Each image's decoder rows [1, tokens_per_image, hidden] (the model dtype), for
        `images` as (hash, pixel_values [channels, image_size, image_size])."""
        for _, pixels in images:
            self._check(pixels)
        with self._lock:
            found = self._cache.found([key for key, _ in images])
            for key, pixels in images:
                if key not in found:
                    found[key] = self._run(pixels)
                    self._cache.remember(key, found[key])
        return [found[key] for key, _ in images]

    def program(self, graphdef, kernels):
        """The tower's run as a pure function of its state and its inputs."""
        return tower_program(graphdef, kernels)

    def _check(self, pixels: np.ndarray) -> None:
        shape = idle_pixels(self.config).shape[1:]
        if pixels.shape != shape:
            raise ValueError(f"an image of pixel values {list(pixels.shape)}, not the "
                             f"{list(shape)} the vision tower takes")

    def _run(self, pixels: np.ndarray) -> np.ndarray:
        program = self._program or self._encode  # --disable-precompile: compiled on first use
        rows = np.asarray(program(self._state, pixels[None].astype(np.float32)))
        self.runs += 1
        return rows.astype(self.dtype)


def idle_pixels(config) -> np.ndarray:
    """float32 [1, channels, image_size, image_size]: what the program is compiled with."""
    return np.zeros((1, config.in_channels, config.image_size, config.image_size), np.float32)


def tower_program(graphdef, kernels):
    """The tower's run as a pure function of its state and one image's pixels [1, C, S, S]."""

    def encode(state, pixels):
        return nnx.merge(graphdef, state)(pixels, kernels)

    return encode
