"""A vision model's prompt with images in the step's inputs (issue 55).

`PromptImages` is what a request with images carries (`Request.prompt_images`, built by the
engine from the vision tower's output): each image's rows of decoder embeddings, which prompt
tokens take them, every prompt token's multimodal RoPE position (model/vision/vision_inputs.py), and
its prefix-cache key. `add_image_rows` writes a step's share of them into its ForwardBatch:
an image token's id becomes -1 and its row of `input_embeds` the image's (the model takes that
row in place of the token's embedding: CausalLM.hidden_states), and `rope_positions` holds the
(temporal, height, width) position of every token row, which the host turns into RoPE's cos
and sin (step_inputs.RopeTable). Positions past the prompt (generated tokens, in any step,
decode continuations too) are the token's index plus the prompt's `rope_delta`.
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
    positions: np.ndarray  # i32[3, prompt length]
    rope_delta: int  # a later token's position minus its index
    # The prompt's ids with each image's placeholder tokens replaced by a key of that image
    # (negative, from its hash): the prefix cache's key (Request.cache_ids).
    cache_key: list[int]

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
    rope = np.broadcast_to(batch.positions, (3, tokens)).copy()
    embeds = None
    for i, prompt in enumerate(prompt_images):
        if prompt is None:
            continue
        start, end = int(batch.cu_q_lens[i]), int(batch.cu_q_lens[i + 1])
        positions = batch.positions[start:end]
        length = prompt.embed_rows.shape[0]
        in_prompt = positions < length
        rope[:, start:end] = positions + prompt.rope_delta
        if not in_prompt.any():
            continue
        rows = np.arange(start, end)[in_prompt]
        rope[:, rows] = prompt.positions[:, positions[in_prompt]]
        embed_rows = prompt.embed_rows[positions[in_prompt]]
        image = embed_rows >= 0
        if image.any():
            if embeds is None:
                embeds = np.zeros((prompt.embeds.shape[0], tokens, hidden_size), dtype)
            batch.input_ids[rows[image]] = -1
            embeds[:, rows[image]] = prompt.embeds[:, embed_rows[image]]
    return dataclasses.replace(batch, rope_positions=rope, input_embeds=embeds)
