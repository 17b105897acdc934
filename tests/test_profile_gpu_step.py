"""benchmarks/profile_gpu_step.py on the CPU: the ncu CSV summary on a trimmed real profile
(tests/data: 8 launches of today's H200 attention profile, IDs 25-28 and 37-40), the step window
bracketing exactly the steady decode steps asked for, and the profiling run end to end on a
2-layer model with the profiler calls as no-ops."""
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ncu_summary  # noqa: E402
import profile_gpu_step  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "data" / "ncu_decode_256x256_trimmed.csv"


def test_summary_of_the_trimmed_profile_gives_each_kernels_time_and_bytes_per_step():
    launches = ncu_summary.read_launches(FIXTURE.read_text())
    assert len(launches) == 8
    rows, skipped = ncu_summary.summarize(launches)
    assert skipped == 0
    by_name = {row.name: row for row in rows}
    assert [row.name for row in rows] == ["_attention_kernel", "input_scatter_fusion",
                                          "loop_pad_fusion", "loop_broadcast_fusion"]
    attention = by_name["_attention_kernel"]
    assert attention.launches == 2 and attention.category == "attention"
    assert attention.seconds == pytest.approx((108_480 + 107_904) * 1e-9)
    assert attention.dram_bytes == 276_902_144 + 6_454_016 + 276_904_704 + 6_444_800
    assert by_name["input_scatter_fusion"].category == "scatter"
    assert by_name["loop_pad_fusion"].category == ncu_summary.OTHER

    totals = ncu_summary.category_totals(rows)
    assert totals["attention"] == (2, pytest.approx(216_384e-9))
    assert totals["scatter"] == (2, pytest.approx((12_768 + 12_320) * 1e-9))
    assert totals["gemm"] == (0, 0.0)
    assert totals[ncu_summary.OTHER] == (4, pytest.approx((7_200 + 6_912 + 3_136 + 3_008) * 1e-9))

    table = ncu_summary.format_summary(rows, steps=2)
    assert "108.2" in table  # the attention kernel's us per step: 216.384 / 2
    assert "130.9 us/step over 2 step(s)" in table  # 261.728 us of kernels / 2 steps
    assert "no multiple of" not in table
    assert "4 kernels ran a number of times that is no multiple of 3" in \
        ncu_summary.format_summary(rows, steps=3)


def test_autotuning_launches_are_skipped_and_gemm_names_are_told_apart():
    header = FIXTURE.read_text().splitlines()[3]
    redzone = ('"90","451","python3.12","127.0.0.1","RedzoneChecker","1","14","(128, 1, 1)",'
               '"(8, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum",'
               '"usecond","1.5"')
    launches = ncu_summary.read_launches("\n".join([header, redzone]))
    assert launches == [ncu_summary.Launch("RedzoneChecker", pytest.approx(1.5e-6), None)]
    assert ncu_summary.summarize(launches) == ([], 1)
    assert ncu_summary.format_summary([], 3, skipped=1) == \
        "no kernels in the window (1 autotuning launches skipped)"
    for name in ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm_fusion_dot_12",
                 "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm<1>>(Params)",
                 "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
                 "loop_dot_fusion"):
        assert ncu_summary.category(name) == "gemm", name
    assert ncu_summary.category("loop_reduce_window_fusion") == ncu_summary.OTHER
    assert ncu_summary.short_name(
        "void cutlass::Kernel2<cutlass_80_gemm<(Style)2>>(T1::Params)") == \
        "cutlass::Kernel2<cutlass_80_gemm>"


def test_a_csv_without_the_time_metric_or_with_an_unknown_unit_fails_naming_it():
    lines = FIXTURE.read_text().splitlines()
    no_time = "\n".join(line for line in lines if "gpu__time_duration" not in line)
    with pytest.raises(ValueError, match="gpu__time_duration.sum"):
        ncu_summary.read_launches(no_time)
    odd_unit = "\n".join(line.replace('"ns"', '"cycle"') for line in lines)
    with pytest.raises(ValueError, match="unit 'cycle'"):
        ncu_summary.read_launches(odd_unit)


def test_summarize_takes_the_step_count_from_the_window_line(tmp_path):
    csv = tmp_path / "ncu_step.csv"
    window = ncu_summary.WINDOW_MARKER + '{"steps": 2, "rows": 256, "kv_tokens_mean": 260, ' \
                                         '"floor_ms": 0.1}'
    csv.write_text(window + "\n" + FIXTURE.read_text())
    table = profile_gpu_step.summarize_file(str(csv), None, top=40)
    assert "130.9 us/step over 2 step(s)" in table
    assert "1.31x the floor" in table  # 0.1309 ms of kernels a step against 0.1 ms


# --- the window --------------------------------------------------------------------------------

class FakeRunner:
    def __init__(self, log):
        self.log, self.last_tokens = log, jnp.zeros(4, jnp.int32)

    def run(self, staged, token_bitmask=None):
        self.log.append(("run", staged.shape))
        self.last_tokens = self.last_tokens + 1
        return self.last_tokens


class Recorder:
    description = "recorder"

    def __init__(self, log):
        self.log = log

    def start(self):
        self.log.append("start")

    def stop(self):
        self.log.append("stop")


def _scheduler(rows: int, waiting: int):
    request = SimpleNamespace(is_decoding=waiting == 0, num_tokens=20)
    return SimpleNamespace(num_waiting=waiting, num_running=rows, running=[request] * rows)


def test_the_window_brackets_exactly_the_steps_after_the_skipped_steady_ones():
    log = []
    core = SimpleNamespace(runner=FakeRunner(log), scheduler=None)
    window = profile_gpu_step.StepWindow(core, rows=4, skip=2, steps=3, profiler=Recorder(log))
    window.install()
    for i in range(10):  # 3 prefill steps (requests waiting), then steady decode
        window.scheduler = _scheduler(4, waiting=max(0, 3 - i))
        core.runner.run(SimpleNamespace(shape=(8, 4, 2 if i < 3 else 4)))
    window.uninstall()
    events = [e if isinstance(e, str) else e[1][2] for e in log]
    assert events == [2, 2, 2, 4, 4, "start", 4, 4, 4, "stop", 4, 4]
    assert window.done.is_set() and window.error is None
    assert window.shapes == [(8, 4, 4)] * 3 and window.kv_tokens == [20, 20]
    assert core.runner.run.__func__ is FakeRunner.run  # uninstalled


def test_a_batch_that_changes_inside_the_window_ends_it_with_an_error():
    log = []
    core = SimpleNamespace(runner=FakeRunner(log), scheduler=None)
    window = profile_gpu_step.StepWindow(core, rows=4, skip=0, steps=3, profiler=Recorder(log))
    window.install()
    for rows in (4, 3, 3):
        window.scheduler = _scheduler(rows, waiting=0)
        core.runner.run(SimpleNamespace(shape=(8, 4, 4)))
    assert "stop" in log and window.done.is_set()
    assert "the batch changed" in str(window.error)


def test_the_cpu_gets_no_op_profiler_calls():
    profiler = profile_gpu_step.cuda_profiler("cpu")
    profiler.start()
    profiler.stop()
    assert "no-ops" in profiler.description


def test_profiling_runs_end_to_end_on_a_tiny_model_on_the_cpu(capsys):
    assert profile_gpu_step.main(["--model-config", "tiny", "--rows", "4", "--context", "16",
                                  "--steps", "2", "--max-prefill", "64"]) == 0
    out = capsys.readouterr().out
    report = ncu_summary.window_info(out)
    assert "profiler calls are no-ops" in out
    assert report["steps"] == 2 and report["rows"] == 4
    assert report["shapes"] == [[8, 4, report["shapes"][0][2]]]  # the decode bucket, 4 rows
    assert 16 < report["kv_tokens_mean"] < 16 + 40 and report["wall_ms_per_step"] > 0
