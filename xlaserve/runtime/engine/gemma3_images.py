"""Gemma 3's request images -> its prompt ids and PromptImages (gemma-3-4b/12b/27b-it).

Gemma's chat template writes `<start_of_image>` (boi) where a message has an image, and
transformers' Gemma3Processor replaces each in the text with "\\n\\n" + boi +
mm_tokens_per_image `<image_soft_token>`s + eoi + "\\n\\n" before tokenizing. The prompt here is
ids: each boi becomes those tokens, the newlines at either edge merged with a newline run
beside them into the one token the vocabulary has for the whole run ("\\n" then "\\n\\n" is
"\\n\\n\\n"), which is what tokenizing the text gives (vLLM's Gemma 3 processor makes the same
merges). The image processor is transformers' Gemma3ImageProcessorPil as the checkpoint's
preprocessor_config.json sets it: resized to the tower's square (bilinear), rescaled,
normalized; pan-and-scan off, as transformers has it by default (a config that turns it on is
refused: its crops are not built). Each image's tokens form a whole span (PromptImages.
whole_spans): they attend to one another, so the scheduler runs them in one step and the prefix
cache does not end inside them, which start-up checks the prompt budget allows.
"""
from __future__ import annotations

import hashlib
import logging
import os

import numpy as np

from xlaserve.runtime.engine.image_prompts import ImagePrompts
from xlaserve.runtime.executor.image_rows import PromptImages
from xlaserve.runtime.executor.towers.siglip_encoder import SiglipEncoder
from xlaserve.runtime.scheduler.scheduler import prefill_budget

logger = logging.getLogger(__name__)

MOST_NEWLINES = 31  # the longest newline run Gemma's vocabulary has one token for
PROCESSOR_FILE = "preprocessor_config.json"


class Gemma3ImagePrompts(ImagePrompts):
    def __init__(self, config, processor, encoder: SiglipEncoder, max_images: int,
                 hidden_size: int, dtype, newline_ids: dict[int, int]):
        """`newline_ids`: the token of each run of newlines the vocabulary has, by its length
        (2 at least)."""
        super().__init__(config, processor, encoder, max_images, hidden_size, dtype)
        self.newline_ids = newline_ids
        self._newlines_of = {token: count for count, token in newline_ids.items()}

    def prepare(self, prompt_ids: list[int], images: list) -> tuple[list[int],
                                                                  PromptImages | None]:
        """(the prompt's ids with each `<start_of_image>` expanded, its PromptImages) for
        `images` (PIL images, in the prompt's order); (prompt_ids, None) without images.
        ValueError where the placeholders and the images do not match."""
        c = self.config
        if c.image_token_id in prompt_ids:
            raise ValueError("the prompt holds image tokens (<image_soft_token>): write one "
                             "<start_of_image> per image, which is expanded here")
        places = self.placeholders(prompt_ids, images, c.boi_token_id, " (<start_of_image>)")
        if not images:
            return prompt_ids, None
        pixels = np.asarray(self.processor(images=images, return_tensors="np")["pixel_values"],
                            np.float32)
        keys = [hashlib.sha256(p.tobytes()).hexdigest() for p in pixels]
        rows = self.encoder.embed(list(zip(keys, pixels)))
        tokens = c.tokens_per_image
        ids, spans, start = [], [], 0
        for place in places:
            self._join(ids, prompt_ids[start:place])
            self._join(ids, [self.newline_ids[2], c.boi_token_id])
            spans.append((len(ids), len(ids) + tokens))
            ids += [c.image_token_id] * tokens
            self._join(ids, [c.eoi_token_id, self.newline_ids[2]])
            start = place + 1
        self._join(ids, prompt_ids[start:])
        embed_rows = np.full(len(ids), -1, np.int32)
        cache_key = list(ids)
        for n, ((first, end), key) in enumerate(zip(spans, keys)):
            embed_rows[first:end] = np.arange(n * tokens, (n + 1) * tokens)
            # Negative: never a token id; one value per image, from its hash.
            cache_key[first:end] = [-1 - int(key[:15], 16)] * tokens
        return ids, PromptImages(embeds=np.concatenate(rows, axis=1), embed_rows=embed_rows,
                                 positions=None, rope_delta=0, cache_key=cache_key,
                                 whole_spans=tuple(spans))

    def _join(self, ids: list[int], more: list[int]) -> None:
        """`ids` + `more`, a newline run ending `ids` and one starting `more` merged where the
        vocabulary has a token for the whole run."""
        if ids and more and ids[-1] in self._newlines_of and more[0] in self._newlines_of:
            merged = self.newline_ids.get(self._newlines_of[ids[-1]] + self._newlines_of[more[0]])
            if merged is not None:
                ids[-1], more = merged, more[1:]
        ids += more


def refuse_split_images(args, tokens: int, image: str) -> None:
    """ValueError where a step cannot hold an image of `tokens` tokens whose tokens attend to
    one another (`image`, naming them: Gemma 3's, Gemma 4's, gemma4_images.py): a prefill chunk
    or a step's prompt budget beside as many decodes under them."""
    whole = f"{image} attend to one another and run in one step"
    if 0 < (args.chunked_prefill_size or tokens) < tokens:
        raise ValueError(f"--chunked-prefill-size {args.chunked_prefill_size}: {whole}")
    budget = prefill_budget(args.max_prefill_tokens, args.max_running_requests)
    if budget < tokens:
        raise ValueError(f"--max-prefill-tokens {args.max_prefill_tokens} with "
                         f"--max-running-requests {args.max_running_requests}: a step beside "
                         f"as many decodes has room for {budget} prompt tokens; {whole}")


def gemma3_image_prompts(args, loaded, runner, tokenizer, model_dir: str, max_images: int
                         ) -> Gemma3ImagePrompts | None:
    """The server's Gemma3ImagePrompts, or ValueError naming what it cannot run: a prompt
    budget that cannot hold an image's tokens in one step, --mm-processor-kwargs, pan-and-scan,
    a processor size other than the tower's. None without a tokenizer (--skip-tokenizer-init):
    text is served, images refused per request."""
    from transformers import Gemma3ImageProcessorPil

    config = loaded.config.vision
    if tokenizer is None:
        logger.warning("Gemma 3 without its tokenizer (--skip-tokenizer-init): requests with "
                       "images are refused (an image's prompt needs its newline tokens)")
        return None
    refuse_split_images(args, config.tokens_per_image, f"a Gemma 3 image's "
                        f"{config.tokens_per_image} tokens")
    if args.mm_processor_kwargs:
        raise ValueError("--mm-processor-kwargs: Gemma 3's images are resized to the tower's "
                         f"{config.image_size} pixels; none are taken")
    if os.path.exists(os.path.join(model_dir, PROCESSOR_FILE)):
        processor = Gemma3ImageProcessorPil.from_pretrained(model_dir)
    else:  # transformers' defaults (gemma-3's file sets them but the size) at the tower's size
        logger.info("No %s: images resized to %d pixels, normalized as transformers' Gemma 3 "
                    "processor does by default", PROCESSOR_FILE, config.image_size)
        processor = Gemma3ImageProcessorPil(size={"height": config.image_size,
                                                  "width": config.image_size})
    if processor.do_pan_and_scan:
        raise ValueError("do_pan_and_scan: Gemma 3's pan-and-scan crops are not supported "
                         "(the image processor's config turns them on; transformers has them "
                         "off by default)")
    size = (processor.size.height, processor.size.width)
    if size != (config.image_size, config.image_size):
        raise ValueError(f"the image processor resizes to {size}, not the vision tower's "
                         f"{config.image_size} square")
    vocabulary = tokenizer.get_vocab()
    newline_ids = {n: vocabulary["\n" * n] for n in range(1, MOST_NEWLINES + 1)
                   if "\n" * n in vocabulary}
    if 2 not in newline_ids:
        raise ValueError("Gemma 3's images need a \"\\n\\n\" token in the vocabulary")
    return Gemma3ImagePrompts(config, processor, SiglipEncoder(loaded, runner.kernels),
                              max_images, config.out_hidden_size, loaded.dtype, newline_ids)
