"""benchmarks/accelerator_check.py --quick end to end on CPU (the GPU kernel interpreted, a 2-layer
dummy model, the server in a subprocess), so that the command meant for a GPU machine is known to
run before one is at hand. About a minute on a 2-core CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import jax

from xlaserve.cache_root import private_dir
from xlaserve.native.build import cache_dir as kernels_dir

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "accelerator_check.py"


def test_quick_run_writes_every_section_and_passes_every_check(tmp_path):
    """The GPU check's whole command at CPU size, in a subprocess: ~65 s on a 2-core CPU, its
    steps each compiling their own programs (the tiny model's engine, again with LoRA slots, the
    attention and MoE kernels interpreted, a server loading the executable cache)."""
    out = tmp_path / "accelerator_check.json"
    # The executable cache on, in a folder of this test (as on the GPU machine, where the
    # server loads the steps the first model's engine stored); the native kernels and JAX's
    # compilation cache are this session's, not built again (g++ for every kernel: 95 s of this
    # test became 65 s without, 2026-11-28).
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / "kernels").symlink_to(private_dir(kernels_dir()), target_is_directory=True)
    if jax.config.jax_compilation_cache_dir:
        (cache / "xla").symlink_to(jax.config.jax_compilation_cache_dir, target_is_directory=True)
    env = {**os.environ, "XLASERVE_EXECUTABLE_CACHE": "1", "XLASERVE_CACHE_DIR": str(cache)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--lora", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())

    assert results["passed"] and results["failures"] == []
    for section in ("environment", "attention_correctness", "latent_attention_correctness",
                    "bandwidth", "attention_timing", "moe_layer", "warm_start", "server",
                    "models", "lora"):
        assert section in results and "error" not in results[section], section
    assert results["environment"]["backend"] == "cpu"

    cases = results["attention_correctness"]["cases"]
    assert {(c["batch"], c["dtype"]) for c in cases} == {
        (b, d) for b in ("decode", "prefill", "mixed", "ragged") for d in ("float32", "bfloat16")}
    assert all(c["passed"] and c["cache_equal"] and c["max_abs_error"] <= c["tolerance"]
               for c in cases)
    latent = results["latent_attention_correctness"]["cases"]  # DeepSeek's MLA kernel
    assert {(c["batch"], c["dtype"]) for c in latent} == {
        (b, d) for b in ("decode", "prefill", "mixed") for d in ("float32", "bfloat16")}
    assert all(c["passed"] and c["cache_equal"] for c in latent)

    assert results["bandwidth"]["copy_gbps"] > 0
    assert {r["implementation"] for r in results["attention_timing"]["rows"]} >= {"reference (XLA)"}

    moe = results["moe_layer"]["rows"]  # the GPU grouped matmul, interpreted, at 1 and 8 tokens
    assert [(r["tokens"], r["projection"]) for r in moe] == [
        (1, "gate_up"), (1, "down"), (8, "gate_up"), (8, "down")]
    assert all(r["passed"] and r["floor_ms"] > 0 and r["interpreted"] for r in moe)
    # A second start of the first model: its steps from the executable cache.
    assert results["warm_start"]["model"] == "tiny" and results["warm_start"]["startup_s"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "| decode step | tiny batch 8 |" in report and "| moe layer |" in report
    svg = (tmp_path / "steps.svg").read_text()
    ElementTree.fromstring(svg)  # well-formed
    assert svg.count("<polyline") == 2  # the tiny model's steps and its floor

    assert results["server"]["passed"] and results["server"]["completion_tokens"] == 8
    # The server runs the first model's engine: every step loaded from the executable cache
    # that engine wrote, none compiled (a cold compile beside the check took 152 s on an H200).
    assert results["server"]["steps_compiled"] == 0 and results["server"]["steps_loaded"] > 0

    model = results["models"]["tiny"]
    assert [d["batch"] for d in model["decode"]] == [1, 8]
    assert all(d["step_ms"] > 0 and 0 < d["floor_ms"] for d in model["decode"])
    [verify] = model["verify"]  # speculative decoding's verified rows, the real program
    assert verify["row_tokens"] == 5 and verify["verify_ms"] > 0 and verify["decode_ms"] > 0
    assert model["offline"]["output_tok_s"] > 0
    # --lora: the first model again with adapter slots, rows of no adapter and of both adapters,
    # each beside the model's own step at that batch; the floor counts the slots' bytes.
    lora = results["lora"]
    assert (lora["model"], lora["slots"], lora["rank"]) == ("tiny", 2, 4)
    assert [(d["batch"], d["adapters"]) for d in lora["decode"]] == [(1, 0), (1, 2), (8, 0), (8, 2)]
    assert all(d["step_ms"] > 0 and d["vs_base"] > 0 for d in lora["decode"])
    assert lora["slot_bytes"] > 0
    floors = {d["batch"]: d["floor_ms"] for d in model["decode"]}
    assert all(d["floor_ms"] > floors[d["batch"]] for d in lora["decode"])
    assert "| lora decode step | tiny 2 of 2 adapters, batch 8 |" in report
    assert "PASSED" in run.stdout


def test_a_failed_check_or_a_step_error_fails_the_run():
    sys.path.insert(0, str(SCRIPT.parent))
    from accelerator_check import failures

    results = {"server": {"skipped": "no fastapi"}, "bandwidth": {"copy_gbps": 1.0},
               "attention_correctness": {"passed": False, "cases": [{"passed": True},
                                                                    {"passed": False}]},
               "models": {"tiny": {"error": "OOM"}}}
    assert failures(results) == ["/attention_correctness", "/attention_correctness/cases[1]",
                                 "/models/tiny"]


def test_the_summary_of_a_run_cut_short_by_its_budgets_prints_each_skip(capsys):
    """The H100 run of 2026-11-26: cold starts spent the models' budgets and the attention
    checks skipped their bfloat16 cases; its summary had crashed on the first skipped case."""
    import json

    sys.path.insert(0, str(SCRIPT.parent))
    from accelerator_report import print_summary

    path = SCRIPT.parents[1] / "docs/results/h100-2026-11-26/accelerator_check.json"
    print_summary(json.loads(path.read_text()))
    lines = capsys.readouterr().out.splitlines()
    skipped = [line for line in lines if line.rstrip().endswith("SKIP")]
    # attention cases, latent cases, the server, each model's 3 decode batches and offline run
    assert len(skipped) == 4 + 4 + 1 + 2 * 4, "\n".join(lines)
    assert any("bfloat16" in line and "budget is spent" in line for line in skipped)
    assert lines[-1] == "PASSED"


def test_the_report_of_a_measured_run_plots_each_model_beside_its_floor(tmp_path):
    """The H200 run of 2026-11-27 (b) redrawn: report.md lists its figures, steps.svg has a line
    for each model's steps and one for its floor, and is well-formed."""
    sys.path.insert(0, str(SCRIPT.parent))
    from accelerator_report import write_report

    path = SCRIPT.parents[1] / "docs/results/h200-2026-11-27-b/accelerator_check.json"
    report, plot = write_report(json.loads(path.read_text()), str(tmp_path))
    text = Path(report).read_text()
    assert "| decode step | llama-3.1-8b batch 256 |" in text and "NVIDIA H200" in text
    svg = Path(plot).read_text()
    ElementTree.fromstring(svg)
    assert svg.count("<polyline") == 4 and "llama-3.1-8b floor" in svg


def test_the_full_plans_models_are_real_configs_cut_where_asked(tmp_path):
    """The device run's models: Llama-3.1-8B whole, Qwen3-30B-A3B's first 8 layers (its 61 GB
    do not fit an H100 beside the KV cache, and 24 layers took 267 s to compile on an H200)."""
    check, lib, _ = _full_plan_modules()
    paths = [lib.config_dir(name, str(tmp_path)) for name in check.PLANS["full"]["models"]]
    layers = [json.loads((Path(p) / "config.json").read_text())["num_hidden_layers"]
              for p in paths]
    assert layers == [32, 8] and Path(paths[1]).name == "qwen3-30b-a3b@8"
    assert set(check.PLANS["full"]["budgets"]) >= {"llama-3.1-8b", "qwen3-30b-a3b@8",
                                                   "moe_layer", "warm_start"}
    budgets, total = dict(check.PLANS["full"]["budgets"]), check.PLANS["full"]["time_budget_s"]
    lora = budgets.pop("lora")  # --lora's step, opt-in: with one model (docs/accelerator_check.md)
    assert sum(budgets.values()) <= total
    assert budgets["llama-3.1-8b"] + lora <= total


# --- compiled for an H100 in CI, before a GPU runs them ------------------------------------------

def _full_plan_modules():
    sys.path.insert(0, str(SCRIPT.parent))
    import accelerator_check
    import accelerator_lib
    import bench_attention

    return accelerator_check, accelerator_lib, bench_attention


def test_every_attention_shape_of_the_gpu_check_compiles_for_an_h100():
    """The full plan's correctness cases (both dtypes) and its timing batches, compiled by Triton
    for the deviceless H100 as the check would run them: a shape the GPU kernel refuses fails
    here, not in the first minutes of a lent GPU."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from tests.compile_targets import compile_for, devices
    from xlaserve.runtime.executor import aot
    from xlaserve.pallas_kernels.ragged_paged_attention import kernel_gpu

    _, h100 = devices("h100")
    check, lib, bench = _full_plan_modules()
    plan = check.PLANS["full"]
    mesh = Mesh(np.array(h100[:1]).reshape(1, 1), ("data", "tensor"))
    kernel = jax.jit(kernel_gpu.ragged_paged_attention, static_argnames=("sm_scale",))
    abstract = lambda arrays: {k: aot.abstract(v.shape, v.dtype, mesh, P()) for k, v in arrays.items()}
    rng = np.random.default_rng(0)
    compiled = []
    for dtype in ("float32", "bfloat16"):
        for name, (heads, seqs) in check.attention_batches(plan, rng).items():
            case = lib.make_attention_case(rng, seqs, dtype=jnp.dtype(dtype), **heads)
            compile_for(mesh, kernel, **abstract(case), sm_scale=case["q"].shape[-1] ** -0.5)
            compiled.append((name, dtype))
    for name, (num_seqs, q_len, kv_len) in plan["bench_batches"].items():
        batch = jax.eval_shape(lambda: bench.make_batch(
            num_seqs, q_len, kv_len, page_size=16, dtype=jnp.dtype(plan["bench_dtype"]),
            **plan["bench_heads"]))
        compile_for(mesh, kernel, **abstract(batch), sm_scale=0.1)
        compiled.append((name, plan["bench_dtype"]))
    latent_kernel = jax.jit(kernel_gpu.mla_ragged_paged_attention,
                            static_argnames=("sm_scale", "value_dim"))
    heads = plan["latent_heads"]
    # The latent cases: bfloat16's three, float32's decode (a float32 mixed batch of the latent
    # kernel is compiled by test_compile_mla_kernels.py --slow): ~25 s a compile here.
    for dtype in ("float32", "bfloat16"):
        for name, (_, seqs) in check.attention_batches(plan, rng).items():
            if name != "ragged" and (dtype == "bfloat16" or name == "decode"):
                case = lib.make_latent_attention_case(rng, seqs, dtype=jnp.dtype(dtype), **heads)
                compile_for(mesh, latent_kernel, **abstract(case), sm_scale=0.1,
                            value_dim=heads["value_dim"])
                compiled.append((name, dtype))
    assert len(compiled) == 8 + len(plan["bench_batches"]) + 4


def test_a_gpu_serving_step_goes_into_the_executable_cache(tmp_path):
    """The executable cache stores a compiled H100 serving step (its Triton attention kernel, its
    cuBLAS GEMMs): serialized, written whole, readable back. Loading needs the GPU itself, which
    the server's first start there does (runtime/compile/executable_cache.py)."""
    import pickle

    import jax

    from tests.compile_targets import devices
    from xlaserve.runtime.compile import executable_cache
    from xlaserve.runtime.executor import aot
    from xlaserve.runtime.sampling.step_needs import PLAIN
    from xlaserve.server_args import ServerArgs

    devices("h100")
    check, lib, _ = _full_plan_modules()
    plan = check.PLANS["full"]
    args = ServerArgs(model_path=lib.config_dir("qwen2.5-0.5b"), max_running_requests=8,
                      max_prefill_tokens=64, context_length=plan["context"],
                      max_total_tokens=8 * plan["context"])
    program, shapes, description = aot.server_step("h100", args)
    # The plain variant (greedy rows): what is stored is the point, not which parts (the
    # variant with every part took 23.7 s of this test, 2026-11-28).
    step_args, kwargs = program.lowering_args(*shapes[0], PLAIN)
    cache = executable_cache.ExecutableCache(tmp_path)
    path = cache.path(step_args, kwargs, name="serving step", description=description)
    with jax.set_mesh(program.mesh):
        cache.compile_and_store(program.step, step_args, kwargs, path)

    data = path.read_bytes()
    header = executable_cache._HEADER
    magic, _, length = header.unpack_from(data)
    assert magic == executable_cache.MAGIC and length == len(data) - header.size, description
    executable, in_tree, out_tree, kernels = pickle.loads(data[header.size:])
    assert len(executable) > 100_000 and in_tree.num_leaves == len(jax.tree.leaves(step_args))
    assert kernels == ()  # the native kernels are the CPU's: a GPU step calls none
