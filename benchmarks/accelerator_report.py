"""The one device run's report (benchmarks/accelerator_check.py): the summary it prints, and in
the results folder a markdown table of every figure and check (report.md) and a plot of the
models' decode steps against their floors, step time over rows (steps.svg, drawn here: the GPU
image has no plotting package we can count on). `python benchmarks/accelerator_report.py
RESULTS.json [DIR]` redraws both from a run's JSON."""
from __future__ import annotations

import os
import sys

from svg_plot import line_svg


def status(result: dict) -> str:
    """PASS / FAIL for checks, FAIL for errors, SKIP, and nothing for a plain figure."""
    if "skipped" in result:
        return "SKIP"
    if "error" in result or result.get("passed") is False:
        return "FAIL"
    return "PASS" if result.get("passed") else ""


def error_text(result: dict) -> str:
    if "error" in result:
        return result["error"][:100]
    if "skipped" in result:
        return result["skipped"]
    error = result["max_abs_error"]
    shown = "non-finite" if error is None else f"{error:.2e}"
    cache = "" if result["cache_equal"] else ", cache differs"
    return f"max abs error {shown} (tol {result['tolerance']}){cache}"


def step_text(step: dict) -> str:
    return (f"{step['step_ms']:.2f} ms/step, floor {step['floor_ms']:.2f} ms "
            f"({100 * step['of_roofline']:.0f}% of roofline), {step['tok_s']:.0f} tok/s")


def vs_base_text(step: dict) -> str:
    """A LoRA step against the model's own step without LoRA, where it was measured."""
    if step.get("vs_base") is None:
        return ""
    return f"; without LoRA {step['base_step_ms']:.2f} ms ({step['vs_base']:.2f}x)"


def summary_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(section, item, figure, status) for each figure and check of a run's results."""
    rows = []
    env = results.get("environment", {})
    if "device_kind" in env:
        rows.append(("environment", f"{env['device_kind']} ({env['backend']})",
                     f"jax {env['versions']['jax']}, python {env['python']}", ""))
    for section, label in (("attention_correctness", "attention"),
                           ("latent_attention_correctness", "latent attention")):
        for case in results.get(section, {}).get("cases", []):
            rows.append((label, f"{case['batch']} {case['dtype']}", error_text(case),
                         status(case)))
    bw = results.get("bandwidth", {})
    if "copy_gbps" in bw:
        rows.append(("bandwidth", "device copy", f"{bw['copy_gbps']:.0f} GB/s; roofline uses "
                     f"{bw['hbm_gbps']:.0f} ({bw['hbm_source']})", ""))
    for row in results.get("attention_timing", {}).get("rows", []):
        rows.append(("attention timing", f"{row['batch']}, {row['implementation']}",
                     f"{row['ms']:.3f} ms, {row['gb_s']:.0f} GB/s ({100 * row['of_hbm']:.0f}% of HBM)", ""))
    for row in results.get("moe_layer", {}).get("rows", []):
        figure = row.get("skipped") or (
            f"{row['ms']:.3f} ms, {row['of_floor']:.2f}x floor; ragged_dot {row['ragged_dot_ms']:.3f}"
            f" ms; error {row['relative_error']:.1e}")
        rows.append(("moe layer", f"{row['model']} {row['tokens']} tokens {row['projection']}",
                     figure, status(row)))
    lora = results.get("lora", {})
    for step in lora.get("decode", []):
        figure = step.get("error") or step.get("skipped") or (step_text(step) + vs_base_text(step))
        rows.append(("lora decode step", f"{lora['model']} {step['adapters']} of {lora['slots']}"
                     f" adapters, batch {step['batch']}", figure, status(step)))
    if "startup_s" in lora:
        rows.append(("start-up", f"{lora['model']} {lora['slots']} LoRA slots of rank "
                     f"{lora['rank']}, cold",
                     f"{lora['startup_s']:.1f} s", ""))
    for key in ("error", "skipped"):
        if key in lora:
            rows.append(("lora", "", str(lora[key]), status(lora)))
    warm = results.get("warm_start", {})
    if "startup_s" in warm:
        rows.append(("start-up", f"{warm['model']} warm", f"{warm['startup_s']:.1f} s", ""))
    server = results.get("server", {})
    if server:
        figure = server.get("skipped") or server.get("error") or (
            f"{server['status_code']}, {server['completion_tokens']} tokens, ready in {server['ready_s']:.0f} s")
        rows.append(("server", "/v1/completions", figure, status(server)))
    for model, result in results.get("models", {}).items():
        if "startup_s" in result:
            rows.append(("start-up", f"{model} cold", f"{result['startup_s']:.1f} s", ""))
        for step in result.get("decode", []):
            figure = step.get("error") or step.get("skipped") or step_text(step)
            rows.append(("decode step", f"{model} batch {step['batch']}", figure, status(step)))
        for v in result.get("verify", []):
            figure = v.get("error") or v.get("skipped") or (
                f"{v['verify_ms']:.2f} ms for {v['row_tokens']} tokens a row, decode "
                f"{v['decode_ms']:.2f} ms: {v['verify_over_decode']:.2f}x")
            rows.append(("verify step", f"{model} batch {v['batch']}", figure, status(v)))
        o = result.get("offline", {})
        if o:
            figure = o.get("error") or o.get("skipped") or (f"{o['output_tok_s']:.0f} tok/s from {o['num_prompts']} prompts, "
                                        f"ceiling {o['ceiling_tok_s']:.0f} ({100 * o['of_ceiling']:.0f}%)")
            rows.append(("offline", model, figure, status(o)))
        for key in ("error", "skipped"):
            if key in result:
                rows.append(("model", model, str(result[key]), status(result)))
    return rows


def print_summary(results: dict) -> None:
    rows = summary_rows(results)
    print(f"\n{'section':<17} {'item':<40} {'figure':<72} status")
    for section, item, figure, status in rows:
        print(f"{section:<17} {item[:40]:<40} {figure[:72]:<72} {status}")
    print(f"\n{'PASSED' if results['passed'] else 'FAILED: ' + ', '.join(results['failures'])}")


def write_report(results: dict, directory: str) -> list[str]:
    """report.md and steps.svg in `directory`; their paths."""
    os.makedirs(directory, exist_ok=True)
    env = results.get("environment", {})
    lines = [f"# Device run: {env.get('device_kind', '?')} ({env.get('backend', '?')})", "",
             f"jax {env.get('versions', {}).get('jax', '?')}, mode {results.get('mode')}, "
             f"{results.get('elapsed_s', '?')} s; "
             + ("**passed**" if results.get("passed") else
                "**failed**: " + ", ".join(results.get("failures", []))), "",
             "| section | item | figure | status |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |"
              for row in summary_rows(results)]
    lines += ["", "![decode step time against rows, beside the floor](steps.svg)", ""]
    report, plot = os.path.join(directory, "report.md"), os.path.join(directory, "steps.svg")
    with open(report, "w") as f:
        f.write("\n".join(lines))
    with open(plot, "w") as f:
        f.write(steps_svg(results))
    return [report, plot]


def steps_svg(results: dict) -> str:
    """Each model's decode step (ms, solid) and floor (dashed) over rows (log scale)."""
    series = []
    for model, result in results.get("models", {}).items():
        steps = [s for s in result.get("decode", []) if "step_ms" in s]
        if steps:
            series.append((model, [(s["batch"], s["step_ms"]) for s in steps], False))
            series.append((f"{model} floor", [(s["batch"], s["floor_ms"]) for s in steps], True))
    return line_svg(series, "rows (decode batch)", "ms", empty="no decode step was measured")


if __name__ == "__main__":
    import json

    with open(sys.argv[1]) as f:
        loaded = json.load(f)
    print("\n".join(write_report(loaded, sys.argv[2] if len(sys.argv) > 2
                                 else os.path.dirname(os.path.abspath(sys.argv[1])))))
