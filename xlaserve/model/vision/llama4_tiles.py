"""Llama 4's image processor in NumPy and PIL: an image as the vision encoder's tiles, ported from
transformers' Llama4ImageProcessor (which runs on torchvision only; this server does not need
it).

    canvas = the best grid of up to `max_patches` tiles of `tile` pixels (best_canvas: the
             smallest upscale that fits the image, else the least downscale; the smaller area
             on a tie), the upscale capped at the tile's size unless resize_to_max_canvas
    image  -> resized into the canvas keeping its aspect ratio (bilinear), padded with black at
              the right and bottom, rescaled and normalized, cut into rows x columns tiles
              (row-major); more than one: the whole image resized to one tile after them.

The rescale and normalization run in bfloat16, as transformers' override does (each operation
rounded to bfloat16 in turn), so the values are transformers' to the bit where the resized
pixels are. The resize is PIL's bilinear filter with its antialiasing; transformers' is
torchvision's, whose uint8 kernel (what it runs on AVX2 CPUs) is a port of PIL's, in other
fixed-point steps: a resized pixel differs by one level (1/255) at most. Measured against
torch's uint8 interpolate (tests/vision/test_llama4_images.py), the tiles' values that differ:
Scout's 336-pixel tiles, 12 images of random sizes up to 2016 pixels a side, median 0.02% (smooth
images) and 0.1% (random noise), at most 0.8% and 3%; 32-pixel tiles from images up to 6 times
larger, median 0.3%, at most 11% and 23%. (torchvision's float path, which it takes on other
CPUs, AVX512 ones included, differs from its own uint8 one at 14-22% of the pixels of the same
resizes: transformers' own tiles differ as much between machines.) Where the
canvas's size computes in float32 there (the chosen canvas is a tensor), it does here too: 300
x 200 pixels into a 336-pixel-wide canvas is 503 rows, not the 504 of float64.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class TileProcessor:
    tile: int  # pixels a side (the encoder's image_size)
    max_patches: int = 16  # tiles at most (transformers' name)
    resize_to_max_canvas: bool = False
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def __call__(self, image) -> tuple[np.ndarray, tuple[int, int]]:
        """(float32 [tiles, 3, tile, tile], (rows, columns)) of a PIL RGB image: its tiles, then
        the global one where there are several."""
        from PIL import Image

        width, height = image.size
        canvas = best_canvas((height, width), supported_canvases(self.max_patches, self.tile),
                             self.resize_to_max_canvas)
        size = fitted_size((height, width), canvas, self.tile, self.resize_to_max_canvas)
        resized = np.asarray(image.resize((size[1], size[0]), Image.BILINEAR))
        padded = np.zeros((canvas[0], canvas[1], 3), np.uint8)
        padded[:size[0], :size[1]] = resized
        grid = (canvas[0] // self.tile, canvas[1] // self.tile)
        tiles = self.normalized(padded).reshape(3, grid[0], self.tile, grid[1], self.tile)
        tiles = tiles.transpose(1, 3, 0, 2, 4).reshape(-1, 3, self.tile, self.tile)
        if grid[0] * grid[1] > 1:
            whole = np.asarray(image.resize((self.tile, self.tile), Image.BILINEAR))
            tiles = np.concatenate([tiles, self.normalized(whole)[None]])
        return tiles, grid

    def normalized(self, pixels: np.ndarray) -> np.ndarray:
        """float32 [3, H, W] of uint8 [H, W, 3]: (x * rescale_factor - mean) / std, each step
        rounded to bfloat16 (transformers' rescale_and_normalize in torch.bfloat16)."""
        def bf16(x):
            return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

        x = bf16(pixels.astype(np.float32) * np.float32(self.rescale_factor))
        x = bf16(x - bf16(self.image_mean))
        x = bf16(x / bf16(self.image_std))
        return np.ascontiguousarray(x.transpose(2, 0, 1))

    def max_tiles(self) -> int:
        """Tiles an image may have: max_patches, and the global one beside several."""
        return self.max_patches + 1 if self.max_patches > 1 else 1


def supported_canvases(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """Every (height, width) of up to `max_tiles` tiles, in transformers' order
    (find_supported_resolutions: by aspect ratio as first met from the most tiles down)."""
    by_ratio = collections.defaultdict(list)
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio[rows / (count // rows)].append((rows, count // rows))
    return [(rows * tile, columns * tile) for pairs in by_ratio.values()
            for rows, columns in pairs]


def best_canvas(size: tuple[int, int], canvases: list[tuple[int, int]],
                to_max: bool = False) -> tuple[int, int]:
    """transformers' get_best_fit, its scales in float32 as torch computes them."""
    heights, widths = (np.array([c[i] for c in canvases], np.float32) for i in (0, 1))
    scales = np.minimum(heights / np.float32(size[0]), widths / np.float32(size[1]))
    up = scales[scales >= 1]
    chosen = (up.max() if to_max else up.min()) if up.size else scales[scales < 1].max()
    fits = [c for c, s in zip(canvases, scales) if s == chosen]
    return min(fits, key=lambda c: c[0] * c[1])  # the first of the smallest area


def fitted_size(size: tuple[int, int], canvas: tuple[int, int], tile: int,
                to_max: bool = False) -> tuple[int, int]:
    """(height, width) the image is resized to inside `canvas` (transformers' _preprocess and
    get_max_res_without_distortion). A target side taken from the canvas is a torch tensor
    there, and its arithmetic float32; a side taken from the image or the tile is a Python int."""
    limits = []
    for side, canvas_side in zip(size, canvas):
        if to_max:
            limits.append((canvas_side, True))
        else:  # min(max(side, tile), canvas_side): the canvas's only where strictly smaller
            cap = max(side, tile)
            limits.append((canvas_side, True) if canvas_side < cap else (cap, False))
    (target_h, h32), (target_w, w32) = limits

    def ratio(target, original, f32):
        return np.float32(target) / np.float32(original) if f32 else target / original

    scale_h, scale_w = ratio(target_h, size[0], h32), ratio(target_w, size[1], w32)
    f32 = h32 or w32
    narrower = (np.float32(scale_w) < np.float32(scale_h)) if f32 else scale_w < scale_h
    if narrower:
        grown = np.float32(size[0]) * scale_w if w32 else size[0] * scale_w
        height, width = min(math.floor(grown), target_h), target_w
    else:
        grown = np.float32(size[1]) * scale_h if h32 else size[1] * scale_h
        height, width = target_h, min(math.floor(grown), target_w)
    return max(int(height), 1), max(int(width), 1)
