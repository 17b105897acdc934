"""Predicted image-prompt prefill on H100 and TPU v6e for Qwen2.5-VL-7B (issue 55), from the
compiled programs (no accelerator is used): the vision tower for one image of `--image-tokens`
decoder tokens (4 patches each) and the serving step of a `--step-tokens` prefill bucket with
image rows, both at benchmarks/configs/qwen2.5-vl-7b's shapes, bfloat16.

    .venv/bin/python benchmarks/predict_vision.py                     # every row below
    .venv/bin/python benchmarks/predict_vision.py --targets v6e:2x2          # one target

As benchmarks/predict_embeddings.py: XLA's cost analysis of each optimised program per device
(flops, bytes accessed), time = max(bytes / HBM bandwidth, flops / peak) with the data sheets'
figures (predict_accelerators.PEAKS); the attention kernels are custom calls the analysis counts
as nothing, so their flops are added analytically (4 x keys x head dim x heads a token a layer:
the tower's windows of 64 patches in 28 blocks and whole images in 4; the decoder's causal half
of the prompt). An image prompt is one image and `--text-tokens` of text, prefilled in steps of
`--step-tokens`: time = tower + prompt tokens x (step time / step tokens). XLA's bytes accessed
count every fusion's operands, float32 activations included (the tower's residual stream is
float32, 26 MB a read at 5120 patches): where that makes a program memory-bound, the compute
bound is printed beside it. Collectives and launch gaps are not in it: a lower bound, not a
measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.predict_accelerators import roofline, xla_costs  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "qwen2.5-vl-7b")


def predict(target: str, tp: int, image_tokens: int, text_tokens: int, step_tokens: int) -> dict:
    import jax.numpy as jnp

    from xlaserve.model.sharding import serving_mesh
    from xlaserve.runtime.executor.aot import server_step, target_devices, vision_tower_compiled
    from xlaserve.runtime.sampling.step_needs import StepNeeds
    from xlaserve.server_args import ServerArgs
    from xlaserve.weights.loader import read_config

    config, _ = read_config(CONFIG, load_format="dummy")
    vision = config.vision
    platform, devices = target_devices(target)
    mesh = serving_mesh(devices, tp)
    patches = image_tokens * vision.merge_unit
    tower = vision_tower_compiled(config, jnp.bfloat16, mesh, platform, patches)
    head, heads = vision.head_dim, vision.num_heads
    windowed = sum(vision.windowed(b) for b in range(vision.depth))
    window_patches = (vision.merged_per_window * vision.spatial_merge_size) ** 2
    tower_attention = 4 * head * heads * patches * (
        windowed * window_patches + (vision.depth - windowed) * patches) / tp
    tower_s, tower_flops, tower_bound, tower_compute = roofline(target, xla_costs(tower),
                                                                tower_attention)

    args = ServerArgs(model_path=CONFIG, tp_size=tp, max_running_requests=64,
                      chunked_prefill_size=step_tokens, max_prefill_tokens=step_tokens,
                      context_length=32768)
    program, shapes, description = server_step(target, args)
    tokens, seqs, pages = next(s for s in shapes if s[0] >= step_tokens)
    step = program.compile(tokens, seqs, pages, StepNeeds())  # greedy: a prefill's work
    prompt = image_tokens + text_tokens
    prompts_per_step = max(1, tokens // prompt)
    step_attention = (4 * (prompt / 2) * config.head_dim * config.num_heads * config.num_layers
                      * prompts_per_step * prompt / tp)
    step_s, step_flops, step_bound, step_compute = roofline(target, xla_costs(step),
                                                            step_attention)
    per_prompt = tower_s + prompt * step_s / tokens
    per_prompt_compute = tower_compute + prompt * step_compute / tokens
    return {"target": target, "tp": tp, "description": description, "image_tokens": image_tokens,
            "prompt_tokens": prompt, "tower_ms": tower_s * 1e3, "tower_bound": tower_bound,
            "tower_gflops": tower_flops / 1e9, "step_tokens": tokens, "step_ms": step_s * 1e3,
            "step_bound": step_bound, "step_gflops": step_flops / 1e9,
            "image_prompts_per_s": 1 / per_prompt, "prefill_tokens_per_s": prompt / per_prompt,
            "tower_compute_ms": tower_compute * 1e3, "step_compute_ms": step_compute * 1e3,
            "compute_bound_prompts_per_s": 1 / per_prompt_compute}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="h100,v6e:2x2")
    parser.add_argument("--image-tokens", type=int, default=1280)  # the server's max_pixels cap
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--step-tokens", type=int, default=4096)
    parser.add_argument("--out", help="write the rows here as JSON")
    args = parser.parse_args()
    from xlaserve.runtime.executor.aot import use_compile_only_packages

    use_compile_only_packages()
    rows = []
    for target in args.targets.split(","):
        for tp in ((1, 4) if target.startswith("v6e") else (1,)):
            row = predict(target, tp, args.image_tokens, args.text_tokens, args.step_tokens)
            rows.append(row)
            print(f"{target:8} tp {tp}: tower {row['tower_ms']:.2f} ms an image of "
                  f"{row['image_tokens']} tokens ({row['tower_bound']}-bound, "
                  f"{row['tower_gflops']:.0f} GFLOP a device); step of {row['step_tokens']} "
                  f"tokens {row['step_ms']:.2f} ms ({row['step_bound']}-bound, "
                  f"{row['step_gflops']:.0f} GFLOP) -> {row['image_prompts_per_s']:,.1f} image "
                  f"prompts/s ({row['prefill_tokens_per_s']:,.0f} prompt tokens/s; at the "
                  f"compute bound {row['compute_bound_prompts_per_s']:,.1f}: tower "
                  f"{row['tower_compute_ms']:.2f} ms, step {row['step_compute_ms']:.2f} ms)",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
