"""Gemma4Encoder: Gemma 4's vision tower and embedder (model/vision/gemma4_vision.py) run over
images, one image a run, precompiled per patch bucket at start-up, the rows cached by image.

The processor keeps an image's aspect ratio within a budget of tokens_per_image x pooling^2
patches (gemma-4-31b-it's: 280 tokens, 2520 patches of 16 pixels), so images differ in
patches: each run pads its image to the smallest bucket that holds it, powers of two from the
fewest patches an image can have (Gemma4VisionConfig.fewest_tokens: 124 tokens, 1116 patches)
up to the budget, so no image compiles while serving (gemma-4-31b-it's buckets: 2048 and 2520;
a square image is 48 x 48 patches, 2304, in the second). transformers pads every image to the
budget; the attention keeps to the image's own patches and the pooling drops the rest, so the
bucket changes nothing but the work. A 2520-patch run through gemma-4-31b-it's 27 layers of
width 1152 is ~3.6 TFLOP (its matmuls' 2.8, attention's 0.8): runs are not batched.
"""
from __future__ import annotations

import logging

import numpy as np
from flax import nnx

from xlaserve.runtime.executor.buckets import pow2_buckets
from xlaserve.runtime.executor.towers.siglip_encoder import SiglipEncoder

logger = logging.getLogger(__name__)


class Gemma4Encoder(SiglipEncoder):
    """SiglipEncoder's cache, lock and `embed` over images given as (patches [n, patch_dim],
    positions [n, 2]): the processor's, its padding dropped."""

    def __init__(self, loaded, kernels, cache_tokens: int = 16384):
        super().__init__(loaded, kernels, cache_tokens)
        c = self.config
        self.buckets = pow2_buckets(c.fewest_tokens * c.pooling ** 2, c.max_patches)
        self._programs: dict[int, object] = {}

    def program(self, graphdef, kernels):
        return tower_program(graphdef, kernels)

    def precompile(self) -> None:
        """Every bucket's program, before serving."""
        for patches in self.buckets:
            self._programs[patches] = self._encode.lower(
                self._state, *idle_args(self.config, patches)).compile()
        logger.info("Compiled the vision tower for %d patch buckets (up to %d patches an image)",
                    len(self.buckets), self.config.max_patches)

    def _check(self, pixels) -> None:
        patches, positions = pixels
        c = self.config
        if not (c.fewest_tokens * c.pooling ** 2 <= len(patches) <= c.max_patches) or \
                len(patches) % c.pooling ** 2 or patches.shape[1:] != (c.patch_dim,):
            raise ValueError(f"an image of {len(patches)} patches of {patches.shape[1:]} values, "
                             f"not {c.fewest_tokens * c.pooling ** 2} to {c.max_patches} of "
                             f"{c.patch_dim} as the vision tower takes")

    def _run(self, pixels) -> np.ndarray:
        patches, positions = pixels
        bucket = next(b for b in self.buckets if b >= len(patches))
        program = self._programs.get(bucket)
        if program is None:
            program = self._encode  # --disable-precompile: compiled on first use
            if self._programs:
                logger.warning("COMPILED WHILE SERVING: the vision tower for %d patches was not "
                               "precompiled; every request waited for it", bucket)
        args = padded_args(patches, positions, bucket)
        rows = np.asarray(program(self._state, *args))
        self.runs += 1
        return rows[None, :len(patches) // self.config.pooling ** 2].astype(self.dtype)


def padded_args(patches: np.ndarray, positions: np.ndarray, bucket: int):
    """The tower's arguments: the image's patches and positions padded to `bucket` rows (zeros,
    and -1 as the processor pads), and their count [1]."""
    count = len(patches)
    padded = np.zeros((bucket, patches.shape[1]), np.float32)
    padded[:count] = patches
    where = np.full((bucket, 2), -1, np.int32)
    where[:count] = positions
    return padded, where, np.asarray([count], np.int32)


def idle_args(config, patches: int):
    """A bucket's arguments with one blank token's patches: what its program is compiled with
    (here and for other hardware, aot.vision_tower_compiled)."""
    square = config.pooling ** 2
    positions = np.stack(np.meshgrid(np.arange(config.pooling), np.arange(config.pooling),
                                     indexing="xy"), -1).reshape(square, 2)
    return padded_args(np.zeros((square, config.patch_dim), np.float32), positions, patches)


def tower_program(graphdef, kernels):
    """The tower's run as a pure function of its state and `padded_args`."""

    def encode(state, patches, positions, count):
        return nnx.merge(graphdef, state)(patches, positions, count, kernels)

    return encode
