"""The host side of Qwen2-VL / Qwen2.5-VL's positions, in NumPy: how the vision tower's inputs
are laid out (`encoder_batch`) and the decoder's multimodal RoPE positions of a prompt
(`mrope_positions`), ported from transformers' vision_utils.get_vision_position_ids,
get_vision_window_index and Qwen2_5_VLModel.get_rope_index (images only: a frame pair each).

An image of `grid` (t, h, w) patches (the processor's `image_grid_thw`) comes as t*h*w patch rows,
each 2x2 square of patches consecutive (block-major); it becomes t*h*w / 4 decoder tokens.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from xlaserve.model.config.vision_config import VisionConfig


@dataclasses.dataclass
class EncoderBatch:
    """One call of the vision tower (model/vision/qwen_vision.VisionTower), padded to `patches`
    rows."""

    patches: np.ndarray  # f32[P, patch_dim], in the tower's order (window order in Qwen2.5-VL)
    cos: np.ndarray  # f32[P, head_dim / 2]: each patch's 2D RoPE
    sin: np.ndarray
    cu_windows: np.ndarray  # i32[P / merge_unit + 1]: the windows' starts, then their end
    num_windows: np.ndarray  # i32[1]
    cu_images: np.ndarray  # i32[P / merge_unit + 1]: the images' starts (patch rows)
    num_images: np.ndarray  # i32[1]
    # Qwen3-VL: each patch's learned position as 4 bilinear taps of the square grid (indices,
    # weights); zeros for the others.
    pos_index: np.ndarray  # i32[P, 4]
    pos_weight: np.ndarray  # f32[P, 4]
    # Host only: the tower's merged row of each decoder token of the images in order, and how
    # many tokens each image has.
    merged_rows: np.ndarray
    image_tokens: list[int]

    def split(self, merged: np.ndarray) -> list[np.ndarray]:
        """The tower's output [levels, P / merge_unit, out] as each image's decoder-token rows
        [levels, tokens, out]."""
        rows = merged[:, self.merged_rows]
        return np.split(rows, np.cumsum(self.image_tokens)[:-1], axis=1)


def patch_positions(config: VisionConfig, grid) -> np.ndarray:
    """i64[t*h*w, 2]: each patch row's (row, column) in its image, block-major."""
    t, h, w = (int(n) for n in grid)
    m = config.spatial_merge_size
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // m, m, w // m, m)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([rows, cols], axis=-1), (t, 1))


def position_taps(config: VisionConfig, grid) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-VL's learned positions of an image's patch rows: (i32[t*h*w, 4] indices into the
    square grid's table, f32 weights), the grid resampled to (h, w) bilinearly with its corners
    aligned (transformers' get_vision_interpolation_indices_and_weights)."""
    side = int(round(config.num_position_embeddings ** 0.5))
    t, h, w = (int(n) for n in grid)
    rows, cols = patch_positions(config, grid).T

    def taps(index, size):
        source = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(source)
        low = np.clip(floor.astype(np.int64), 0, side - 1)
        high = np.clip(floor.astype(np.int64) + 1, 0, side - 1)
        upper = (source - floor).astype(np.float32)
        return (low, high), (np.float32(1) - upper, upper)

    (row_taps, row_weights), (col_taps, col_weights) = taps(rows, h), taps(cols, w)
    index = np.stack([r * side + c for r in row_taps for c in col_taps], axis=1)
    weight = np.stack([rw * cw for rw in row_weights for cw in col_weights], axis=1)
    return index.astype(np.int32), weight.astype(np.float32)


def window_order(config: VisionConfig, grids) -> tuple[np.ndarray, list[int]]:
    """(the merged units of `grids`' images in window order, each window's patch count): Qwen2.5-VL
    attends within squares of `merged_per_window` merged tokens a side (smaller at the right and
    bottom edges)."""
    side, unit = config.merged_per_window, config.merge_unit
    order, lengths, first = [], [], 0
    for t, h, w in grids:
        gh, gw = h // config.spatial_merge_size, w // config.spatial_merge_size
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        wh, ww = -(-gh // side), -(-gw // side)
        padded = np.full((t, wh * side, ww * side), -1, np.int64)
        padded[:, :gh, :gw] = index
        windows = padded.reshape(t, wh, side, ww, side).transpose(0, 1, 3, 2, 4)
        windows = windows.reshape(t * wh * ww, side * side)
        for window in windows:
            members = window[window >= 0]
            if members.size:
                order.append(members + first)
                lengths.append(members.size * unit)
        first += t * gh * gw
    return np.concatenate(order), lengths


def vision_rope(config: VisionConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (cos, sin) [P, head_dim / 2] of patch (row, column) `positions`: the first half
    of the pairs rotate by the row, the second by the column (transformers' axial RoPE)."""
    quarter = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))
    angles = np.concatenate([positions[:, :1] * inv_freq, positions[:, 1:] * inv_freq], axis=1)
    angles = angles.astype(np.float32)
    return np.cos(angles), np.sin(angles)


def encoder_batch(config: VisionConfig, pixel_values: list[np.ndarray], grids: list,
                  padded_patches: int) -> EncoderBatch:
    """The tower's inputs for images `pixel_values` (each [t*h*w, patch_dim], the processor's
    rows) of `grids`, padded to `padded_patches` rows (a multiple of merge_unit, at least
    theirs)."""
    grids = [tuple(int(n) for n in g) for g in grids]
    unit = config.merge_unit
    patches = np.concatenate(pixel_values).astype(np.float32)
    num = patches.shape[0]
    if num > padded_patches or padded_patches % unit:
        raise ValueError(f"{num} patches do not fit a bucket of {padded_patches}")
    positions = np.concatenate([patch_positions(config, g) for g in grids])
    cos, sin = vision_rope(config, positions)
    image_lengths = [t * h * w for t, h, w in grids]
    if config.window_size:
        order, window_lengths = window_order(config, grids)
    else:
        order, window_lengths = np.arange(num // unit), image_lengths
    # Whole merged units move together: row r of unit u goes to place order.index(u) * unit + r.
    rows = (order[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)

    def padded(values, width):
        out = np.zeros((padded_patches,) + values.shape[1:], np.float32)
        out[:num] = values[rows]
        return out[:, :width] if width else out

    def segments(lengths):  # starts, then the end (padding entries too)
        cu = np.full(padded_patches // unit + 1, num, np.int32)
        cu[:len(lengths)] = np.cumsum([0] + lengths[:-1])
        return cu, np.array([len(lengths)], np.int32)

    cu_windows, num_windows = segments(window_lengths)
    cu_images, num_images = segments(image_lengths)
    pos_index = np.zeros((padded_patches, 4), np.int32)
    pos_weight = np.zeros((padded_patches, 4), np.float32)
    if config.num_position_embeddings:  # Qwen3-VL (no windows: the rows keep their order)
        taps = [position_taps(config, g) for g in grids]
        pos_index[:num] = np.concatenate([i for i, _ in taps])
        pos_weight[:num] = np.concatenate([w for _, w in taps])
    return EncoderBatch(
        patches=padded(patches, 0), cos=padded(cos, 0), sin=padded(sin, 0),
        cu_windows=cu_windows, num_windows=num_windows, cu_images=cu_images,
        num_images=num_images, pos_index=pos_index, pos_weight=pos_weight,
        merged_rows=np.argsort(order), image_tokens=[n // unit for n in image_lengths])


def mrope_positions(config: VisionConfig, token_ids, grids) -> tuple[np.ndarray, int]:
    """(i32[3, L] (temporal, height, width) positions of a prompt's tokens, the delta every
    later token's position has from its index): text tokens count on from the last position,
    an image's tokens are its (t, row, column) from where it starts, and after an image the
    text resumes past its larger side. `token_ids` holds each image's placeholder tokens
    expanded (image_tokens of its grid, in `grids` order)."""
    ids = np.asarray(token_ids, np.int64)
    is_image = ids == config.image_token_id
    positions = np.zeros((3, ids.size), np.int64)
    m = config.spatial_merge_size
    index, next_position, images = 0, 0, iter(grids)
    while index < ids.size:
        if not is_image[index]:
            end = index
            while end < ids.size and not is_image[end]:
                end += 1
            positions[:, index:end] = next_position + np.arange(end - index)
            next_position += end - index
            index = end
            continue
        grid = next(images, None)
        if grid is None:
            raise ValueError(f"the prompt has more images than the {len(grids)} given")
        t, h, w = (int(n) for n in grid)
        gh, gw = h // m, w // m
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        count = t * gh * gw
        if index + count > ids.size or not is_image[index:index + count].all():
            raise ValueError(f"image at token {index} has {count} tokens; the prompt holds fewer")
        positions[:, index:index + count] = next_position + np.stack(
            [tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)])
        next_position += max(gh, gw)
        index += count
    delta = int(positions.max(initial=-1)) + 1 - ids.size
    return positions.astype(np.int32), delta
