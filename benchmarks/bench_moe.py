"""Times one mixture-of-experts layer, side by side on the same weights: xlaserve's (model/moe.py)
with each grouped matmul of model/grouped_matmul.py, and transformers' own Qwen3-MoE block
(PyTorch, its loop over the experts a step hits).

    python benchmarks/bench_moe.py [--experts 64 --top-k 8 --hidden 1024 --intermediate 384]
        [--tokens 1 16 256] [--iters 20]

The default shape is Qwen3-30B-A3B's layer at half its width and experts (a 2-core CPU holds it in
float32); the figures are milliseconds per layer call and the ratio to transformers'. Both sides
compute in float32 from the same random weights, and the outputs are compared before timing.
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
    args = parser.parse_args()

    import torch
    import transformers
    from flax import nnx

    from xlaserve.model.config import ModelConfig
    from xlaserve.model.grouped_matmul import grouped_matmul_ragged_dot, grouped_matmul_tiled
    from xlaserve.model.layers import Kernels
    from xlaserve.model.moe import MoE
    from xlaserve.model.weights import _experts

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
    ours = MoE(config, jax.numpy.float32, nnx.Rngs(0))
    nnx.update(ours, nnx.from_flat_state(dict(_experts(_BlockSource(block, args.experts), config,
                                                        "", ()))))
    graphdef, state = nnx.split(ours)
    state = jax.device_put(state)  # numpy leaves would be copied in on every call
    kernels = {"tiled": Kernels(attention=None, grouped_matmul=grouped_matmul_tiled),
               "ragged_dot": Kernels(attention=None, grouped_matmul=grouped_matmul_ragged_dot)}
    print(f"{jax.devices()[0].device_kind}: {args.experts} experts, top {args.top_k}, hidden "
          f"{args.hidden}, intermediate {args.intermediate}, float32")
    print(f"{'tokens':>6} {'transformers ms':>16} " + " ".join(f"{n + ' ms':>14} {'ratio':>6}"
                                                           for n in kernels))
    for tokens in args.tokens:
        x = np.random.default_rng(tokens).standard_normal((tokens, args.hidden)).astype(np.float32)
        with torch.no_grad():
            reference = block(torch.from_numpy(x)[None]).numpy()[0]
        hf_ms = _time(lambda: block(torch.from_numpy(x)[None]), args.iters)
        row = f"{tokens:>6} {hf_ms:>16.2f} "
        for kernel in kernels.values():
            step = jax.jit(lambda state, x, k=kernel: nnx.merge(graphdef, state)(x, k))
            np.testing.assert_allclose(np.asarray(step(state, x)), reference, rtol=2e-3, atol=2e-4)
            ms = _time(lambda: step(state, x).block_until_ready(), args.iters)
            row += f"{ms:>14.2f} {hf_ms / ms:>6.2f} "
        print(row)


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
