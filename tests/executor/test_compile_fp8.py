"""FP8 weights in the serving step of Llama-3.1-8B compiled for one H100 without the hardware
(runtime/executor/aot.py): with `--quantization fp8` every projection is an FP8 x FP8 GEMM (XLA's Triton
GEMM with float8_e4m3fn operands: 4 a layer), no FP8 weight is converted to another type
anywhere, XLA's bytes accessed are the FP8 weights' (one byte a weight: half of bfloat16's) and
no temporary could hold a bfloat16 copy of a weight. An FP8 checkpoint with 128x128 block scales,
kept in FP8, multiplies in the block kernel (pallas_kernels/fp8_block_matmul.py) instead. TPU
targets refuse `--quantization fp8` in one line.
"""
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks.predict_accelerators import predict
from tests.compile_targets import compile_for, devices, first_layers
from xlaserve.runtime.executor import aot
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.weight_types.int8 import Fp8Checkpoint
from xlaserve.model.sharding import serving_mesh
from xlaserve.pallas_kernels.fp8_block_matmul import block_fp8_matmul
from xlaserve.server_args import ServerArgs

LLAMA_8B = str(Path(__file__).parents[2] / "benchmarks" / "configs" / "llama-3.1-8b")
FP8 = "f8e4m3fn"
NAME = r"%?([\w.\-]+)"  # an instruction's name; optimized HLO text prefixes it with %


def fp8_weight_bytes(c: ModelConfig, block_k: int | None = None) -> int:
    """Llama-3.1-8B's weights with FP8 projections, from its shapes: the embedding, LM head and
    norms in bfloat16, each layer's qkv, o_proj, gate_up and down one byte a weight, and a float32
    scale a column (per-channel) or a column and K block (block scales)."""
    q, kv, h, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    bfloat16 = 2 * (2 * c.vocab_size * h + (2 * c.num_layers + 1) * h)
    fp8 = h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h
    blocks = (lambda k: 1) if block_k is None else (lambda k: -(-k // block_k))
    scales = 4 * (blocks(h) * (q + 2 * kv) + blocks(q) * h + blocks(h) * 2 * inter + blocks(inter) * h)
    return bfloat16 + c.num_layers * (fp8 + scales)


def _types(block: str) -> dict:
    """Instruction and parameter names of one HLO computation -> their element types."""
    types = dict(re.findall(NAME + r" = (\w+)\[", block))
    types.update(re.findall(r"([\w.\-]+): (\w+)\[", block.split("\n")[0]))
    return types


def _computations(hlo: str) -> list[str]:
    return re.split(r"\n(?=\S)", hlo)  # computations start at column 0


def fp8_gemms(hlo: str) -> int:
    """Dots of the optimized HLO whose two operands are both float8_e4m3fn."""
    found = 0
    for block in _computations(hlo):
        types = _types(block)
        for a, b in re.findall(rf" dot\({NAME}, {NAME}\)", block):
            found += types.get(a) == FP8 and types.get(b) == FP8
    return found


def fp8_kernel_calls(hlo: str) -> int:
    """Triton custom calls (Pallas kernels) with two or more float8_e4m3fn operands."""
    found = 0
    for block in _computations(hlo):
        types = _types(block)
        for operands in re.findall(r" custom-call\(([^)]*)\).*__gpu\$xla\.gpu\.triton", block):
            names = re.findall(NAME, operands)
            found += sum(types.get(n) == FP8 for n in names) >= 2
    return found


def fp8_upcasts(hlo: str) -> list[str]:
    """Converts of an FP8 array to another type: FP8 values dequantized, not multiplied."""
    found = []
    for block in _computations(hlo):
        types = _types(block)
        for line in block.splitlines():
            convert = re.search(rf"= \w+\[[^\]]*\]\S* convert\({NAME}\)", line)
            if convert and types.get(convert.group(1)) == FP8:
                found.append(line.strip()[:200])
    return found


def test_the_hlo_checks_find_fp8_dots_and_an_fp8_weight_dequantized():
    """On the CPU, XLA converts both FP8 operands to float32 before the dot."""
    step = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                    preferred_element_type=jnp.float32))
    args = (jax.ShapeDtypeStruct((8, 256), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((512, 256), jnp.float8_e4m3fn))
    hlo = step.lower(*args).compile().as_text()
    assert len(fp8_upcasts(hlo)) == 2 and fp8_gemms(hlo) == 0
    assert fp8_gemms(step.lower(*args).as_text(dialect="hlo")) == 1  # before the CPU's rewrite


def _smallest_bf16_weight(c: ModelConfig) -> int:
    """Bytes of the smallest projection in bfloat16 (o_proj): a temporary as large could be a
    dequantized copy of a weight."""
    return 2 * c.num_heads * c.head_dim * c.hidden_size


def _decode_step(directory, fp8_checkpoint=None, quantization=None):
    """Llama-3.1-8B's smallest decode step, its first 2 layers (every layer has the same shapes;
    the whole model's compile took 33-42 s of the suite), compiled for an H100."""
    model_path = first_layers("llama-3.1-8b", 2, directory)
    program, shapes, description = aot.server_step("h100", ServerArgs(
        model_path=model_path, max_running_requests=64, quantization=quantization),
        fp8_checkpoint=fp8_checkpoint)
    tokens, seqs, pages = shapes[0]
    assert tokens == seqs == 8, description  # the smallest decode bucket
    config, _ = aot.read_config(model_path, load_format="dummy")
    compiled = program.compile(tokens, seqs, pages)
    return program, compiled, config, predict(program, compiled, "h100", tokens, seqs,
                                              context=1024, config=config)


def test_llama_8b_fp8_decode_step_multiplies_fp8_by_fp8_and_reads_one_byte_a_weight(tmp_path):
    devices("h100")  # skips where the CUDA plugin is absent
    program, compiled, config, row = _decode_step(tmp_path, quantization="fp8")
    weights = jax.tree.leaves(program.args[0])
    assert sum(w.size * w.dtype.itemsize for w in weights) == fp8_weight_bytes(config)
    assert sum(w.dtype == jnp.float8_e4m3fn for w in weights) == 4 * config.num_layers
    hlo = compiled.as_text()
    assert fp8_gemms(hlo) == 4 * config.num_layers
    assert not fp8_upcasts(hlo), fp8_upcasts(hlo)[:3]
    # XLA's bytes (the caches' updates counted as the rows written) against each weight read once,
    # plus, in the variant with prompt logprobs compiled here, the LM head again (over every token
    # row), and the embedding table, which some XLA versions charge whole for a gather of 8 rows
    # (JAX 0.11's does not: the whole model 9.90 GB against 10.14-11.19; these 2 layers 2.86 GB
    # against weights of 2.54). A bfloat16 copy of the FP8 weights
    # shows as an upcast above.
    table_bytes = 2 * config.vocab_size * config.hidden_size
    moved = row["xla_bytes"] + row["cache_write_correction"]
    low, high = row["weights"], row["weights"] + 2 * table_bytes
    assert 0.95 * low < moved < 1.05 * high, (moved / 1e9, low / 1e9, high / 1e9)
    assert compiled.memory_analysis().temp_size_in_bytes < _smallest_bf16_weight(config)


def test_the_block_fp8_kernel_compiles_for_h100_at_llama_8b_shapes():
    _, h100 = devices("h100")
    mesh = serving_mesh(h100, 1)
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(
        mesh, jax.P()))
    for rows, k, n in [(8, 4096, 28672), (256, 14336, 4096)]:  # gate_up, down
        compiled = compile_for(mesh, jax.jit(block_fp8_matmul, static_argnums=3),
                               spec((rows, k), jnp.bfloat16), spec((n, k), jnp.float8_e4m3fn),
                               spec((k // 128, n), jnp.float32), 128)
        hlo = compiled.as_text()
        assert fp8_kernel_calls(hlo) == 1 and not fp8_upcasts(hlo)
        # x's FP8 copy and group scales, the padded rows' output: nothing the weight's size.
        assert compiled.memory_analysis().temp_size_in_bytes < n * k // 8


@pytest.mark.slow
def test_llama_8b_block_fp8_checkpoint_decode_step_multiplies_in_the_block_kernel(tmp_path):
    devices("h100")
    program, compiled, config, row = _decode_step(tmp_path, fp8_checkpoint=Fp8Checkpoint(128))
    weights = jax.tree.leaves(program.args[0])
    assert sum(w.size * w.dtype.itemsize for w in weights) == fp8_weight_bytes(config, 128)
    hlo = compiled.as_text()
    assert fp8_kernel_calls(hlo) == 4 * config.num_layers
    assert not fp8_upcasts(hlo) and fp8_gemms(hlo) == 0, fp8_upcasts(hlo)[:3]
    # The kernels are custom calls, whose reads XLA's cost analysis counts as nothing (nor their
    # activations): it counts the rest, 3.62 GB against 4.20 for the weights other than the
    # kernels' and the two tables charged again. Anything reading the FP8 weights outside the
    # kernels would add 7 GB, a bfloat16 copy of them 14.
    kernel_bytes = sum(w.size * w.dtype.itemsize for w in weights  # values, scales (float32)
                       if w.dtype in (jnp.float8_e4m3fn, jnp.float32))
    table_bytes = 2 * config.vocab_size * config.hidden_size
    moved = row["xla_bytes"] + row["cache_write_correction"]
    assert moved < 1.05 * (row["weights"] - kernel_bytes + 2 * table_bytes), moved / 1e9
    assert compiled.memory_analysis().temp_size_in_bytes < _smallest_bf16_weight(config)


@pytest.mark.parametrize("target,kind", [("v6e:2x2", "TPU v6 lite"), ("v5e:2x2", "TPU v5 lite")])
def test_tpu_targets_refuse_quantization_fp8_in_one_line(target, kind):
    devices(target)
    with pytest.raises(ValueError) as error:
        aot.server_step(target, ServerArgs(model_path=LLAMA_8B, tp_size=4, quantization="fp8"))
    assert "\n" not in str(error.value)
    assert f"--quantization fp8 needs FP8 matmuls, which TPU ({kind}) does not have" in str(error.value)
