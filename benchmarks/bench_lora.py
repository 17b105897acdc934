"""LoRA adapters' cost on the CPU (issue 53): output tokens/s of a batch of `--requests` greedy
requests with 0, 1 and 4 adapters active, on a server with `--max-loras-per-batch` slots of
`--rank` on every module, against the same model served without LoRA: two engines in one
process, their runs alternated, the median of `--rounds`.

    .venv/bin/python benchmarks/bench_lora.py                      # the embedded model
    .venv/bin/python benchmarks/bench_lora.py --model-path benchmarks/configs/qwen2.5-0.5b \
        --load-format dummy --requests 64 --max-new-tokens 32

The adapters are random PEFT files (adapter_config.json + adapter_model.safetensors) of the
model's shapes, made here: what is measured is what the slots and the product cost, not what an
adapter says. Rows of k adapters: the requests split evenly over adapters 1..k. Predicted
figures for H100 and v6e: benchmarks/predict_accelerators.py --lora RANK,SLOTS.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.model_options import add_model_args, engine_model_args, model_vocabulary  # noqa: E402


def write_adapter(directory: str, config, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter on every module of `config` (a ModelConfig)."""
    from safetensors.numpy import save_file

    from xlaserve.server_args import TARGET_MODULES
    from xlaserve.model.lora import module_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (width, axes) in module_shapes(config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, width)) / width
                                                ).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (0.01 * rng.standard_normal(
                (int(np.prod(axes)), rank))).astype(np.float32)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGET_MODULES)}, f)
    return directory


def timed(engine, prompts, params, adapters) -> tuple[float, int]:
    start = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=params, lora_path=adapters)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o["output_ids"]) for o in out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4, help="--max-loras-per-batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)

    from xlaserve.offline import Engine
    from xlaserve.weights.loader import read_config

    vocabulary = model_vocabulary(args.model_path, args.load_format)
    config, _ = read_config(args.model_path, args.load_format)
    rng = np.random.default_rng(0)
    prompts = [rng.choice(vocabulary.allowed_ids, args.prompt_len).tolist()
               for _ in range(args.requests)]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    common = dict(**engine_model_args(args, vocabulary), max_running_requests=args.requests)
    root = tempfile.mkdtemp(prefix="xlaserve-bench-lora-")
    paths = [write_adapter(os.path.join(root, f"a{i}"), config, args.rank, i)
             for i in range(args.slots)]
    cases = {"base model, no --enable-lora": None}
    for active in sorted({0, 1, min(4, args.slots)}):
        cases[f"--enable-lora, {active} adapters active"] = (
            [None] * args.requests if active == 0
            else [f"a{i % active}" for i in range(args.requests)])
    with Engine(**common) as base, Engine(
            **common, lora_paths=[f"a{i}={p}" for i, p in enumerate(paths)],
            max_loras_per_batch=args.slots, max_lora_rank=args.rank,
            lora_target_modules=["all"]) as lora:
        for case, adapters in cases.items():  # warm-up: every shape the runs reach
            timed(base if adapters is None else lora, prompts, params, adapters)
        seconds = {case: [] for case in cases}
        tokens = {}
        for _ in range(args.rounds):
            for case, adapters in cases.items():
                s, n = timed(base if adapters is None else lora, prompts, params, adapters)
                seconds[case].append(s)
                tokens[case] = n
    base_rate = tokens[next(iter(cases))] / statistics.median(seconds[next(iter(cases))])
    rows = []
    print(f"\n{args.requests} requests x {args.prompt_len} prompt + {args.max_new_tokens} output "
          f"tokens, {args.slots} slots of rank {args.rank} on every module; median of "
          f"{args.rounds} alternated rounds")
    print(f"{'case':<40}{'tok/s':>10}{'vs base':>9}")
    for case in cases:
        rate = tokens[case] / statistics.median(seconds[case])
        rows.append({"case": case, "tok_s": rate, "vs_base": rate / base_rate,
                     "seconds": seconds[case]})
        print(f"{case:<40}{rate:>10.1f}{rate / base_rate:>8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
