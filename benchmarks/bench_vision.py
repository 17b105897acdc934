"""Image-prompt prefill on the CPU against transformers (issue 55), side by side in one process:
the same random-weight Qwen2.5-VL model, the same images and prompts, float32, the runs
alternated, the median of `--rounds`.

    .venv/bin/python benchmarks/bench_vision.py                   # 4 prompts of one 448 x 448 image
    .venv/bin/python benchmarks/bench_vision.py --images 8 --image-size 336

The model: Qwen2.5-VL's vision tower at its real shapes (32 blocks of width 1280, windows of 112
pixels, full attention in 4 blocks: the 3B, 7B and 32B models' tower) before a Qwen2.5-0.5B
decoder (24 layers of 896; `--decoder 3b` for Qwen2.5-VL-3B's 36 of 2048, which needs ~30 GB for
the two copies), built with transformers from those shapes (no download) with a word-level
tokenizer. Each prompt is one image (`--image-size` square: (size / 28)^2 tokens) and
`--text-words` words; each round uses new images, so no cache serves them.

Two measures: the tower alone (images per second: transformers' `model.visual` over the
processed pixels of all images in one call, against xlaserve's VisionEncoder packing them into
its buckets), and the whole prefill of every prompt to its first token (image prompts per
second: transformers' forward of the batch, its prompts of one length, against the engine given
every request at once, the image processor and the tower included on both sides). The first
tokens of the two are compared, so a fast wrong answer shows.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_quantized_gemm import cpu_description  # noqa: E402

TOWER = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
             fullatt_block_indexes=[7, 15, 23, 31], window_size=112)
DECODERS = {"0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
            "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2)}
WORDS = [f"w{i}" for i in range(2000)]
MARKERS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
           "<|video_pad|>"]


def build(directory: str, decoder: str, image_size: int):
    import tokenizers
    import torch
    import transformers

    vocabulary = {w: i for i, w in enumerate(["[UNK]", "[PAD]"] + WORDS + MARKERS)}
    ids = {m: vocabulary[m] for m in MARKERS}
    shapes = DECODERS[decoder]
    head_dim = shapes["hidden_size"] // shapes["num_attention_heads"]
    section = [16, 24, 24] if head_dim == 128 else [8, 12, 12]  # 0.5B's heads are 64 wide
    text = dict(vocab_size=len(vocabulary), max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                 "mrope_section": section},
                eos_token_id=ids["<|im_end|>"], **shapes)
    hidden = text["hidden_size"]
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(TOWER, out_hidden_size=hidden),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(directory)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]",
                                         additional_special_tokens=MARKERS).save_pretrained(directory)
    pixels = image_size * image_size
    transformers.Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels).save_pretrained(
        directory)
    return model, ids


def images_for(count: int, size: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
            for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--text-words", type=int, default=32)
    parser.add_argument("--decoder", default="0.5b", choices=sorted(DECODERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()
    import torch
    import transformers

    from xlaserve.offline import Engine
    from xlaserve.runtime.sampling.params import SamplingParams

    directory = tempfile.mkdtemp(prefix="bench-vision-")
    model, ids = build(directory, args.decoder, args.image_size)
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(directory)
    tokens = (args.image_size // 28) ** 2
    placeholders = [ids["<|vision_start|>"], ids["<|image_pad|>"], ids["<|vision_end|>"]]
    prompt = placeholders + list(range(2, 2 + args.text_words))
    figures = {"hf_tower": [], "xla_tower": [], "hf_prefill": [], "xla_prefill": []}
    with Engine(directory, dtype="float32", max_running_requests=args.images,
                chunked_prefill_size=1024, max_prefill_tokens=1024,
                context_length=4096) as engine:
        core = engine.core
        for round_ in range(args.rounds):
            images = images_for(args.images, args.image_size, 2 * round_)
            start = time.perf_counter()  # transformers' tower
            out = processor(images=images, return_tensors="pt")
            with torch.no_grad():
                model.model.visual(out["pixel_values"], grid_thw=out["image_grid_thw"])
            figures["hf_tower"].append(args.images / (time.perf_counter() - start))
            start = time.perf_counter()  # xlaserve's: the images of one request
            core.features.images.prepare(placeholders * args.images, images)
            figures["xla_tower"].append(args.images / (time.perf_counter() - start))

            images = images_for(args.images, args.image_size, 2 * round_ + 1)
            start = time.perf_counter()  # transformers' prefill of the batch
            out = processor(images=images, return_tensors="pt")
            expanded = core.features.images.prepare(prompt, images[:1])[0]  # every prompt's ids alike
            batch = torch.tensor([expanded] * args.images)
            with torch.no_grad():
                logits = model(input_ids=batch, attention_mask=torch.ones_like(batch),
                               pixel_values=out["pixel_values"],
                               image_grid_thw=out["image_grid_thw"],
                               mm_token_type_ids=(batch == ids["<|image_pad|>"]).int(),
                               logits_to_keep=1).logits
            figures["hf_prefill"].append(args.images / (time.perf_counter() - start))
            hf_first = logits[:, -1].argmax(-1).tolist()
            start = time.perf_counter()  # xlaserve's: every request at once
            sinks = [queue.Queue() for _ in images]
            for image, sink in zip(images, sinks):
                ids_, prompt_images = core.features.images.prepare(prompt, [image])
                core.submit(ids_, SamplingParams(max_new_tokens=1, temperature=0,
                                                 ignore_eos=True), sink.put, prompt_images=prompt_images)
            first = [sink.get(timeout=3600).token_id for sink in sinks]
            figures["xla_prefill"].append(args.images / (time.perf_counter() - start))
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in
                                                       figures.items())
                  + f"; first tokens equal: {first == hf_first}", flush=True)
    medians = {k: statistics.median(v) for k, v in figures.items()}
    result = {"images": args.images, "image_size": args.image_size, "image_tokens": tokens,
              "prompt_tokens": len(expanded), "decoder": args.decoder, **medians,
              "tower_ratio": medians["xla_tower"] / medians["hf_tower"],
              "prefill_ratio": medians["xla_prefill"] / medians["hf_prefill"],
              "cpu": cpu_description()}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
