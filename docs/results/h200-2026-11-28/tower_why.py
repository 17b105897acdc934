import os, sys, time, re, collections
sys.path.insert(0, os.getcwd())
import jax, numpy as np
from flax import nnx
from xlaserve.model.vision.vision_inputs import encoder_batch
from xlaserve.runtime.executor.kernels import kernels_for
from xlaserve.runtime.executor.vision_encoder import device_args, tower_program
from xlaserve.weights.loader import load_model
loaded = load_model("benchmarks/configs/qwen2.5-vl-7b", load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, progress=False)
config = loaded.config.vision
graphdef, state = nnx.split(loaded.model.vision)
pixels = np.random.default_rng(0).standard_normal((5120, config.patch_dim), np.float32)
a = jax.device_put(device_args(encoder_batch(config, [pixels], [(1, 80, 64)], 5120)))
for backend in ("auto", "reference"):
    c = jax.jit(tower_program(graphdef, kernels_for(backend, None, matmul_backend="xla"))).lower(state, a).compile()
    jax.block_until_ready(c(state, a)); ts = []
    for _ in range(5):
        t = time.perf_counter(); jax.block_until_ready(c(state, a)); ts.append((time.perf_counter() - t) * 1e3)
    text = c.as_text(); cost = c.cost_analysis(); cost = cost[0] if isinstance(cost, list) else cost
    dots = collections.Counter(m.group(1) for m in re.finditer(r"= (\w+)\[[^\]]*\][^=]*? (?:dot|custom-call)\(", text))
    calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    print(backend, "ms", [round(t, 2) for t in ts], "flops", cost.get("flops"), "dots by out dtype", dict(dots), "custom calls", dict(calls), flush=True)
