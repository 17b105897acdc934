"""Second call of 2026-11-28: the --lora step alone (the first call's LoRA cold start took its
whole 200 s share), against the first call's Llama-3.1-8B steps on the same machine kind."""
import json, os, sys, tempfile, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, os.getcwd())
import accelerator_check as a
import accelerator_lib as lib
plan = a.PLANS["full"]
base = json.load(open(".gpu/base.json"))["models"]["llama-3.1-8b"]
out = os.path.join(os.environ["OUT"], "lora_check.json")
t = time.time()
result = a.benchmark_lora(plan, lib.config_dir("llama-3.1-8b"), 4800.0, base, tempfile.mkdtemp(), lambda: None)
result["elapsed_s"] = time.time() - t
json.dump(result, open(out, "w"), indent=1)
print(json.dumps(result, indent=1))
