"""Times one mixture-of-experts layer, side by side on the same weights: xlaserve's (model/moe.py)
with each grouped matmul (the native grouped GEMM over packed experts, native/grouped_gemm_cpu.cc,
which a single CPU device takes; model/grouped_matmul.py's tiled loop and ragged_dot), and
transformers' own Qwen3-MoE block (PyTorch, its loop over the experts a step hits).

    python benchmarks/bench_moe.py [--experts 64 --top-k 8 --hidden 1024 --intermediate 384]
        [--tokens 1 16 256] [--iters 20] [--runs 3] [--implementations native tiled ragged_dot]

The default shape is Qwen3-30B-A3B's layer at half its width and experts (a 2-core CPU holds it in
float32); the figures are milliseconds per layer call and the ratio to transformers' (its time
over ours: above 1 is faster than transformers), once per run: each run times every
implementation in turn, so that a noisy machine moves them together. Both sides compute in float32
from the same random weights, and the outputs are compared before timing.
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--implementations", nargs="+", choices=["native", "tiled", "ragged_dot"],
                        default=["native", "tiled", "ragged_dot"])
    args = parser.parse_args()

    import torch
    import transformers
    from flax import nnx

    from xlaserve.model.config.model_config import ModelConfig
    from xlaserve.model.grouped_matmul import grouped_matmul_ragged_dot, grouped_matmul_tiled
    from xlaserve.model.layers import Kernels
    from xlaserve.model.moe import MoE
    from xlaserve.model.weight_types.packed import pack_model
    from xlaserve.weights.param_layout import _experts
    from xlaserve.native import gemm_cpu

    hf_config = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden, moe_intermediate_size=args.intermediate,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf_config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.05)
    config = ModelConfig.from_hf(hf_config, "Qwen3MoeForCausalLM")
    weights = nnx.from_flat_state(dict(_experts(_BlockSource(block, args.experts), config, "", ())))
    layers = {}  # implementation -> (graphdef, state, kernels)
    for name in args.implementations:
        ours = MoE(config, jax.numpy.float32, nnx.Rngs(0))
        nnx.update(ours, weights)
        kernels = Kernels(attention=None, grouped_matmul=grouped_matmul_tiled)
        if name == "native":  # the experts packed, as the ModelRunner packs them on one CPU device
            pack_model(ours, tie_word_embeddings=False)
            kernels = Kernels(attention=None, grouped_matmul=grouped_matmul_tiled,
                              packed_grouped_matmul=gemm_cpu.packed_grouped_matmul)
        elif name == "ragged_dot":
            kernels = Kernels(attention=None, grouped_matmul=grouped_matmul_ragged_dot)
        graphdef, state = nnx.split(ours)
        layers[name] = graphdef, jax.device_put(state), kernels  # numpy leaves: copied every call
    print(f"{jax.devices()[0].device_kind}: {args.experts} experts, top {args.top_k}, hidden "
          f"{args.hidden}, intermediate {args.intermediate}, float32; {args.runs} runs, "
          f"{args.iters} calls each")
    print(f"{'tokens':>6}  {'implementation':<14} {'ms per call, each run':<30} "
          f"transformers' ms / ours, each run")
    for tokens in args.tokens:
        x = np.random.default_rng(tokens).standard_normal((tokens, args.hidden)).astype(np.float32)
        with torch.no_grad():
            reference = block(torch.from_numpy(x)[None]).numpy()[0]
        calls = {"transformers": lambda: block(torch.from_numpy(x)[None])}
        for name, (graphdef, state, kernels) in layers.items():
            step = jax.jit(lambda state, x, g=graphdef, k=kernels: nnx.merge(g, state)(x, k))
            np.testing.assert_allclose(np.asarray(step(state, x)), reference, rtol=2e-3, atol=2e-4)
            calls[name] = lambda step=step, state=state: step(state, x).block_until_ready()
        times = {name: [] for name in calls}
        for _ in range(args.runs):
            for name, call in calls.items():
                times[name].append(_time(call, args.iters))
        for name, ms in times.items():
            ratios = "" if name == "transformers" else " / ".join(
                f"{hf / ours:.2f}" for hf, ours in zip(times["transformers"], ms, strict=True))
            print(f"{tokens:>6}  {name:<14} {' / '.join(f'{t:.2f}' for t in ms):<30} {ratios}")


class _BlockSource:
    """transformers' fused expert tensors, read back as a checkpoint's per-expert names."""

    def __init__(self, block, num_experts: int):
        gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2I, H]
        down = block.experts.down_proj.detach().numpy()  # [E, H, I]
        inter = gate_up.shape[1] // 2
        self.tensors = {"mlp.gate.weight": block.gate.weight.detach().numpy()}
        for e in range(num_experts):
            self.tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
            self.tensors[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
            self.tensors[f"mlp.experts.{e}.down_proj.weight"] = down[e]

    def names(self):
        return set(self.tensors)

    def get(self, name):
        return self.tensors[name]


def _time(fn, iters: int) -> float:
    """Milliseconds per call of `fn` after one warm-up call (without autograd for PyTorch)."""
    import torch

    with torch.no_grad():
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e3


if __name__ == "__main__":
    main()
