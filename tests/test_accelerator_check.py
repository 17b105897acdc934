"""benchmarks/accelerator_check.py --quick end to end on CPU (the GPU kernel interpreted, a 2-layer
dummy model, the server in a subprocess), so that the command meant for a GPU machine is known to
run before one is at hand. About a minute on a 2-core CPU."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "accelerator_check.py"


def test_quick_run_writes_every_section_and_passes_every_check(tmp_path):
    out = tmp_path / "accelerator_check.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(out.read_text())

    assert results["passed"] and results["failures"] == []
    for section in ("environment", "attention_correctness", "bandwidth", "attention_timing",
                    "server", "models"):
        assert section in results and "error" not in results[section], section
    assert results["environment"]["backend"] == "cpu"

    cases = results["attention_correctness"]["cases"]
    assert {(c["batch"], c["dtype"]) for c in cases} == {
        (b, d) for b in ("decode", "prefill", "mixed", "ragged") for d in ("float32", "bfloat16")}
    assert all(c["passed"] and c["cache_equal"] and c["max_abs_error"] <= c["tolerance"]
               for c in cases)

    assert results["bandwidth"]["copy_gbps"] > 0
    assert {r["implementation"] for r in results["attention_timing"]["rows"]} >= {"reference (XLA)"}

    assert results["server"]["passed"] and results["server"]["completion_tokens"] == 8

    model = results["models"]["tiny"]
    assert [d["batch"] for d in model["decode"]] == [1, 8]
    assert all(d["step_ms"] > 0 and 0 < d["floor_ms"] for d in model["decode"])
    assert model["offline"]["output_tok_s"] > 0
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
