"""Gemma 4's request images -> its prompt ids and PromptImages (gemma-4-31b/26b-a4b/e2b/e4b-it).

Gemma 4's chat template writes `<|image|>` (image_token_id) where a message has an image, and
transformers' Gemma4Processor replaces each with boi + one `<|image|>` per soft token + eoi
before tokenizing, the soft tokens as many as the processor makes of that image (at most
tokens_per_image: its aspect ratio kept within the patch budget). The prompt here is ids: each
placeholder becomes those tokens (markers of their own in the vocabulary: no text merges with
them). The image processor is transformers' Gemma4ImageProcessorPil as the checkpoint's
processor config sets it (bicubic resize to whole pooling squares of patches, pixels rescaled
to [0, 1], patchified with each patch's (column, row), padded to the budget: the padding is
dropped here). Where the config says (use_bidirectional_attention "vision": 31B, 26B) each
image's tokens form a whole span (PromptImages.whole_spans): they attend to one another in the
sliding layers, so the scheduler runs them in one step and the prefix cache does not end
inside them, which start-up checks the prompt budget allows; otherwise (e2b, e4b) they are
causal and cut anywhere.
"""
from __future__ import annotations

import hashlib
import logging
import os

import numpy as np

from xlaserve.runtime.engine.gemma3_images import refuse_split_images
from xlaserve.runtime.engine.image_prompts import ImagePrompts
from xlaserve.runtime.executor.towers.gemma4_encoder import Gemma4Encoder
from xlaserve.runtime.executor.image_rows import PromptImages

logger = logging.getLogger(__name__)

# Where the processor's settings are: transformers 5's saves, the published checkpoints' (nested).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class Gemma4ImagePrompts(ImagePrompts):
    def prepare(self, prompt_ids: list[int], images: list) -> tuple[list[int],
                                                                  PromptImages | None]:
        """(the prompt's ids with each `<|image|>` expanded, its PromptImages) for `images` (PIL
        images, in the prompt's order); (prompt_ids, None) without images. ValueError where the
        placeholders and the images do not match."""
        c = self.config
        places = self.placeholders(prompt_ids, images, c.image_token_id, " (<|image|>)")
        if not images:
            return prompt_ids, None
        processed = self.processor(images=images, return_tensors="np")
        pixels = []
        for patches, positions in zip(processed["pixel_values"],
                                      processed["image_position_ids"]):
            real = (positions >= 0).all(axis=-1)  # the processor pads with (-1, -1)
            pixels.append((np.asarray(patches[real], np.float32),
                           np.asarray(positions[real], np.int32)))
        keys = [hashlib.sha256(p.tobytes() + w.tobytes()).hexdigest() for p, w in pixels]
        rows = self.encoder.embed(list(zip(keys, pixels)))
        ids, spans, start = [], [], 0
        for place, image_rows in zip(places, rows):
            ids += prompt_ids[start:place] + [c.boi_token_id]
            spans.append((len(ids), len(ids) + image_rows.shape[1]))
            ids += [c.image_token_id] * image_rows.shape[1] + [c.eoi_token_id]
            start = place + 1
        ids += prompt_ids[start:]
        embed_rows = np.full(len(ids), -1, np.int32)
        cache_key, row = list(ids), 0
        for (first, end), key in zip(spans, keys):
            embed_rows[first:end] = np.arange(row, row + end - first)
            row += end - first
            # Negative: never a token id; one value per image, from its hash.
            cache_key[first:end] = [-1 - int(key[:15], 16)] * (end - first)
        return ids, PromptImages(embeds=np.concatenate(rows, axis=1), embed_rows=embed_rows,
                                 positions=None, rope_delta=0, cache_key=cache_key,
                                 whole_spans=tuple(spans) if c.whole_images else ())


def gemma4_image_prompts(args, loaded, runner, model_dir: str, max_images: int
                         ) -> Gemma4ImagePrompts:
    """The server's Gemma4ImagePrompts, or ValueError naming what it cannot run: a prompt budget
    that cannot hold an image's tokens in one step (where they see one another),
    --mm-processor-kwargs, a processor whose budget is not the config's."""
    from transformers import Gemma4ImageProcessorPil

    config = loaded.config.vision
    tokens = config.tokens_per_image
    if config.whole_images:
        refuse_split_images(args, tokens, f"a Gemma 4 image's up to {tokens} tokens")
    if args.mm_processor_kwargs:
        raise ValueError("--mm-processor-kwargs: Gemma 4's images are sized by the checkpoint's "
                         "processor (max_soft_tokens); none are taken")
    if any(os.path.exists(os.path.join(model_dir, name)) for name in PROCESSOR_FILES):
        processor = Gemma4ImageProcessorPil.from_pretrained(model_dir)
    else:  # transformers' defaults at the config's budget and patches
        logger.info("No %s: images sized as transformers' Gemma 4 processor does by default, "
                    "up to %d tokens", " or ".join(PROCESSOR_FILES), tokens)
        processor = Gemma4ImageProcessorPil(max_soft_tokens=tokens, patch_size=config.patch_size,
                                            pooling_kernel_size=config.pooling)
    if (processor.max_soft_tokens, processor.patch_size, processor.pooling_kernel_size) != (
            tokens, config.patch_size, config.pooling):
        raise ValueError(f"the image processor makes images of up to "
                         f"{processor.max_soft_tokens} tokens of {processor.pooling_kernel_size}"
                         f"^2 patches of {processor.patch_size} pixels; the config's vision tower "
                         f"takes {tokens} of {config.pooling}^2 of {config.patch_size} "
                         "(vision_soft_tokens_per_image, pooling_kernel_size, patch_size)")
    return Gemma4ImagePrompts(config, processor, Gemma4Encoder(loaded, runner.kernels),
                              max_images, config.out_hidden_size, loaded.dtype)
