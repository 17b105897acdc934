"""A vision model's prompt with images in the step's inputs (issue 55).

`PromptImages` is what a request with images carries (`Request.prompt_images`, built by the
engine from the vision tower's output): each image's rows of decoder embeddings, which prompt
tokens take them, every prompt token's multimodal RoPE position (model/vision/vision_inputs.py;
none for Gemma 3, whose RoPE is the plain one), its prefix-cache key, and (Gemma 3) the spans of
tokens that attend to one another. `add_image_rows` writes a step's share of them into its
ForwardBatch: an image token's id becomes negative, one value per image of the step (-1, -2,
...: Gemma 3's step tells its images apart by them,
pallas_kernels/ragged_paged_attention/image_spans.py), and its row of `input_embeds` the image's
(the model takes that row in place of the token's embedding: CausalLM.hidden_states); with
multimodal RoPE, `rope_positions` holds the (temporal, height, width) position of every token
row, which the host turns into RoPE's cos and sin (step_inputs.RopeTable). Positions past the
prompt (generated tokens, in any step, decode continuations too) are the token's index plus the
prompt's `rope_delta`.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from xlaserve.runtime.executor.forward_batch import ForwardBatch


@dataclasses.dataclass(frozen=True)
class PromptImages:
    # [levels, image tokens, hidden]: every image's decoder rows, in prompt order: the
    # embeddings, then Qwen3-VL's DeepStack rows (VisionConfig.levels).
    embeds: np.ndarray
    embed_rows: np.ndarray  # i32[prompt length]: each token's row of `embeds`, -1 for text
    positions: np.ndarray | None  # i32[3, prompt length]; None: the plain RoPE (Gemma 3)
    rope_delta: int  # a later token's position minus its index
    # The prompt's ids with each image's placeholder tokens replaced by a key of that image
    # (negative, from its hash): the prefix cache's key (Request.cache_ids).
    cache_key: list[int]
    # Gemma 3: each image's tokens [start, end), which attend to one another, so that a step
    # runs all or none of them and a cached prefix ends outside them
    # (runtime/scheduler/request.whole_span_end). Empty: causal throughout (Qwen-VL).
    whole_spans: tuple[tuple[int, int], ...] = ()

    @property
    def num_image_tokens(self) -> int:
        return int(self.embeds.shape[1])


def add_image_rows(batch: ForwardBatch, prompt_images: list, hidden_size: int,
                        dtype) -> ForwardBatch:
    """`batch` with its image rows: `prompt_images[i]` is sequence i's PromptImages or
    None (a text request: equal positions, which is the plain RoPE). Sets `rope_positions`
    [3, T] and, where a row takes an image's embedding, `input_embeds` [levels, T, hidden]
    (`dtype`)."""
    if all(prompt is None for prompt in prompt_images):  # text only: the plain RoPE, no rows
        return batch
    tokens = batch.input_ids.shape[0]
    multimodal = any(p is not None and p.positions is not None for p in prompt_images)
    rope = np.broadcast_to(batch.positions, (3, tokens)).copy() if multimodal else None
    embeds, images = None, 0
    for i, prompt in enumerate(prompt_images):
        if prompt is None:
            continue
        start, end = int(batch.cu_q_lens[i]), int(batch.cu_q_lens[i + 1])
        positions = batch.positions[start:end]
        length = prompt.embed_rows.shape[0]
        in_prompt = positions < length
        if rope is not None:
            rope[:, start:end] = positions + prompt.rope_delta
        if not in_prompt.any():
            continue
        rows = np.arange(start, end)[in_prompt]
        if rope is not None and prompt.positions is not None:
            rope[:, rows] = prompt.positions[:, positions[in_prompt]]
        embed_rows = prompt.embed_rows[positions[in_prompt]]
        image = embed_rows >= 0
        if image.any():
            if embeds is None:
                embeds = np.zeros((prompt.embeds.shape[0], tokens, hidden_size), dtype)
            # One negative id per image of the step: an image opens where the row before is
            # text or not the row's predecessor, or where a whole span starts (Gemma 3's).
            follows = np.concatenate([[False], image[:-1] & (embed_rows[:-1] + 1 ==
                                                             embed_rows[1:])])
            starts = np.isin(positions[in_prompt], [a for a, _ in prompt.whole_spans])
            opens = image & (~follows | starts)
            batch.input_ids[rows[image]] = -images - np.cumsum(opens)[image]
            images += int(opens.sum())
            embeds[:, rows[image]] = prompt.embeds[:, embed_rows[image]]
    return dataclasses.replace(batch, rope_positions=rope, input_embeds=embeds)
