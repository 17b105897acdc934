"""The pieces of benchmarks/accelerator_check.py: the environment, a NaN-poisoned attention case
builder, device bandwidth, decode-step and throughput timings against the roofline floor, and a
server smoke test. Each function returns plain numbers (JSON-ready); the script guards and prints.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np

from bench_attention import device_seconds
from model_options import first_layers_config
from xlaserve.pallas_kernels.ragged_paged_attention import cases

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS_DIR = os.path.join(REPO_ROOT, "benchmarks", "configs")
VERSIONED = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "libtpu", "flax",
             "transformers", "torch", "numpy")
# What the server smoke test needs beyond the GPU image (gguf only for the embedded model).
OPTIONAL = ("fastapi", "uvicorn", "orjson", "python_multipart", "gguf", "openai")
SERVER_NEEDS = ("fastapi", "uvicorn", "orjson", "openai")
# Published HBM bandwidths (GB/s) by device kind; the first match wins, so specific names go first.
HBM_GBPS = (("H100 PCIe", 2000), ("H100 NVL", 3900), ("H100", 3350), ("H200", 4800),
            ("TPU v5 lite", 819), ("TPU v5", 2765), ("TPU v6", 1640))


# --- environment -------------------------------------------------------------------------------

def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def environment() -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    return {
        "python": platform.python_version(), "executable": sys.executable,
        "versions": {name: version(name) for name in VERSIONED},
        "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
        "device_kind": device.device_kind,
        "memory": {k: stats[k] for k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")
                   if k in stats} if stats else None,
        "importable": {name: importable(name) for name in OPTIONAL},
    }


# --- attention correctness ---------------------------------------------------------------------

def boundary_lengths(page_size: int, longest: int) -> list[int]:
    """kv lengths on, one before and one past page boundaries, up to `longest`."""
    lengths = {1, 2, longest}
    for pages in (1, 2, 8, longest // page_size):
        lengths |= {pages * page_size - 1, pages * page_size, pages * page_size + 1}
    return sorted(n for n in lengths if 1 <= n <= longest)


def random_sequences(rng, num_seqs: int, max_q: int, max_kv: int) -> list[tuple[int, int]]:
    """(q_len, kv_len) pairs, half of them decodes, the rest chunks with or without history."""
    seqs = []
    for _ in range(num_seqs):
        kv_len = int(rng.integers(1, max_kv + 1))
        q_len = 1 if rng.random() < 0.5 else int(rng.integers(1, min(kv_len, max_q) + 1))
        seqs.append((q_len, kv_len))
    return seqs


def make_attention_case(rng, seqs, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype):
    """Inputs of one ragged batch (numpy), poisoned where a kernel must not read (cases.py), with
    two padding sequence rows, five padding tokens and spare pages."""
    return cases.make_case(rng, seqs, **_case_sizes(seqs, page_size), num_kv_heads=num_kv_heads,
                           num_q_heads=num_q_heads, head_dim=head_dim, dtype=dtype)


def make_latent_attention_case(rng, seqs, *, num_q_heads, row_dim, page_size, dtype, **_):
    """`make_attention_case` for multi-head latent attention (cases.make_mla_case)."""
    return cases.make_mla_case(rng, seqs, **_case_sizes(seqs, page_size),
                               num_q_heads=num_q_heads, row_dim=row_dim, dtype=dtype)


def _case_sizes(seqs, page_size) -> dict:
    """A case's sizes: two padding sequence rows, five padding tokens and spare pages."""
    needed = [-(-kv // page_size) for _, kv in seqs]
    return dict(max_seqs=len(seqs) + 2, num_tokens=sum(q for q, _ in seqs) + 5,
                page_size=page_size, pages_per_seq=max(needed) + 1, num_pages=sum(needed) + 4)


def kernel_under_test(backend: str, name: str = "ragged_paged_attention"):
    """(name, jitted kernel) of this platform's Pallas kernel `name` (or
    "mla_ragged_paged_attention"); on CPU the GPU kernel interpreted."""
    from xlaserve.pallas_kernels.ragged_paged_attention import kernel_gpu, kernel_tpu

    label, module, interpret = {"tpu": ("pallas tpu", kernel_tpu, False),
                                "gpu": ("pallas gpu", kernel_gpu, False)}.get(
        backend, ("pallas gpu, interpreted", kernel_gpu, True))
    fn = functools.partial(getattr(module, name), interpret=interpret)
    return label, jax.jit(fn, static_argnames=_static_names(name))


def _static_names(name: str) -> tuple[str, ...]:
    return ("sm_scale", "value_dim") if name.startswith("mla_") else ("sm_scale",)


@functools.cache
def _reference(name: str):
    from xlaserve.pallas_kernels.ragged_paged_attention import reference

    return jax.jit(getattr(reference, name), static_argnames=_static_names(name))


def compare_with_reference(kernel, case: dict, tol: float, value_dim: int | None = None) -> dict:
    """Max abs error of the kernel's output rows (padding rows included: both must give 0) and
    whether the cache it returns equals the reference's, NaN where NaN. `value_dim`: the case is
    multi-head latent attention's (make_latent_attention_case)."""
    args = {k: jnp.asarray(v) for k, v in case.items()}
    sm_scale = case["q"].shape[-1] ** -0.5
    static = {} if value_dim is None else {"value_dim": value_dim}
    name = "ragged_paged_attention" if value_dim is None else "mla_ragged_paged_attention"
    out, cache = kernel(**args, sm_scale=sm_scale, **static)
    with jax.default_matmul_precision("highest"):  # the specification, not TF32
        want, want_cache = _reference(name)(**args, sm_scale=sm_scale, **static)
    as_f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    out, want = as_f32(out), as_f32(want)
    error = np.abs(out - want)
    finite = bool(np.isfinite(out).all())
    max_error = float(error.max()) if finite else None
    close = finite and bool((error <= tol + tol * np.abs(want)).all())
    cache_equal = bool(np.array_equal(as_f32(cache), as_f32(want_cache), equal_nan=True))
    return {"max_abs_error": max_error, "tolerance": tol, "finite": finite,
            "cache_equal": cache_equal, "passed": close and cache_equal}


# --- bandwidth and the roofline ----------------------------------------------------------------

def copy_bandwidth_gbps(nbytes: int, iters: int) -> float:
    """Device read + write bandwidth of an elementwise pass over `nbytes` (x + 1, so that XLA
    cannot elide it): 2 * nbytes moved per call, the calls enqueued back to back
    (`device_seconds`). The input is donated and threaded through, so the pass runs in place and
    no call pays for a fresh output buffer (page faults on CPU)."""
    step = jax.jit(lambda a: a + 1, donate_argnums=0)
    buffer = [jnp.ones(nbytes // 4, jnp.float32)]

    def one_pass():
        buffer[0] = step(buffer[0])
        return buffer[0]

    return 2 * nbytes / device_seconds(one_pass, iters) / 1e9


def published_hbm_gbps(device_kind: str) -> float | None:
    return next((gbps for name, gbps in HBM_GBPS if name in device_kind), None)


def weight_bytes_read_per_step(loaded) -> int:
    """Bytes of weights one decode step reads: all of them, less an untied input embedding, of
    which a step reads only its rows."""
    from flax import nnx

    arrays = {}  # by identity: a packed weight may hold a stack that several layers share
    for path, variable in nnx.to_flat_state(nnx.state(loaded.model)):
        if path != ("embedding",) or loaded.config.tie_word_embeddings:
            arrays.update((id(x), x) for x in jax.tree.leaves(variable.get_value()))
    return sum(x.nbytes for x in arrays.values())


# --- model timings -----------------------------------------------------------------------------

def write_tiny_config(directory: str) -> str:
    """A 2-layer Qwen2 config.json (hidden 64, GQA 4:2, vocabulary 512) for CPU-sized runs."""
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory


def config_dir(name: str, scratch: str | None = None) -> str:
    """A folder of benchmarks/configs by name, or a path as given; "NAME@LAYERS" is that config
    cut to its first LAYERS decoder layers, written under `scratch` (a model whose whole weights
    do not fit the device: every layer has the same shapes, so a step's figures against its
    floor hold, each for the weights it reads)."""
    name, _, layers = name.partition("@")
    path = os.path.join(CONFIGS_DIR, name) if os.path.isdir(os.path.join(CONFIGS_DIR, name)) else name
    if not layers:
        return path
    with open(os.path.join(path, "config.json")) as f:
        config = first_layers_config(json.load(f), int(layers))
    cut = os.path.join(scratch or tempfile.mkdtemp(), f"{os.path.basename(path)}@{layers}")
    os.makedirs(cut, exist_ok=True)
    with open(os.path.join(cut, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return cut


class ModelBench:
    """One dummy-weight Engine and the roofline figures of its steps.

    A decode step is timed as the difference of two runs that differ only in output length,
    (T(long) - T(short)) / (long - short), so the prefill and the ramp up and down of the batch
    cancel out; `short` must outlast the prefill of the whole batch."""

    def __init__(self, model_path: str, *, hbm_gbps: float, max_running: int, context_length: int,
                 max_prefill_tokens: int, token_buckets: list[int], dtype: str = "auto",
                 **engine_options):
        """`engine_options`: further xlaserve.Engine arguments (ServerArgs fields)."""
        import xlaserve
        from xlaserve.runtime.executor.buckets import max_step_tokens

        self.hbm_gbps, self.rng = hbm_gbps, np.random.default_rng(0)
        # The buckets the runs need and the largest step, not every power of two: each program
        # of an 8B model takes a while to compile.
        # 8 is the smallest bucket on GPU and TPU anyway (buckets.default_token_buckets).
        largest = max_step_tokens(max_running, max_prefill_tokens)
        buckets = sorted({max(8, b) for b in token_buckets if b < largest} | {largest})
        start = time.perf_counter()
        # Also the server check's flags (server_flags): its steps are then these, loaded from
        # the executable cache this engine writes, where compiling them cold beside this
        # process took 152 s on an H200 (2026-11-27).
        self.options = dict(
            load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
            max_running_requests=max_running, context_length=context_length,
            max_total_tokens=max_running * context_length, max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=max_prefill_tokens, disable_radix_cache=True,
            precompile_token_paddings=",".join(map(str, buckets)), **engine_options)
        self.engine = xlaserve.Engine(model_path=model_path, log_level="warning", **self.options)
        self.startup_s = time.perf_counter() - start
        loaded = self.engine.core.loaded
        self.config, self.dtype = loaded.config, loaded.dtype
        self.weight_bytes = weight_bytes_read_per_step(loaded)
        lora = self.engine.core.runner.lora
        if lora.spec is not None:  # every slot's A and B: the masked product reads them all
            self.weight_bytes += lora.nbytes
        self.bad_ids = {loaded.config.bos_token_id, *loaded.config.eos_token_ids}

    def prompts(self, count: int, low: int, high: int) -> list[list[int]]:
        """Random token ids (no BOS/EOS), fresh each call so no run reuses another's KV."""
        lengths = self.rng.integers(low, high + 1, count)
        ids = lambda n: [int(t) if t not in self.bad_ids else 3
                         for t in self.rng.integers(3, self.config.vocab_size, n)]
        return [ids(n) for n in lengths]

    def generate_seconds(self, prompts, output_len: int, lora_path=None) -> float:
        params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
        start = time.perf_counter()
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params,
                                       lora_path=lora_path)
        seconds = time.perf_counter() - start
        made = sum(len(o["output_ids"]) for o in outputs)
        if made != output_len * len(prompts):
            raise AssertionError(f"{made} tokens made, {output_len * len(prompts)} asked")
        return seconds

    def floor_step_s(self, batch: int, context: float) -> tuple[float, int]:
        """(seconds, bytes): the roofline floor of a decode step of `batch` sequences of
        `context` tokens each: weights plus every sequence's KV, read once at HBM bandwidth."""
        from xlaserve.runtime.executor.kv_pool import bytes_per_token

        token_bytes = bytes_per_token(self.config, self.dtype, jax.devices()[0].platform)
        nbytes = self.weight_bytes + int(batch * context * token_bytes)
        return nbytes / (self.hbm_gbps * 1e9), nbytes

    def decode_step(self, batch: int, input_len: int, short: int, long: int,
                    adapters: list[str] = ()) -> dict:
        """`adapters`: LoRA adapters' names, the rows spread over them in turn (none: the base
        model's rows)."""
        lora = [adapters[i % len(adapters)] for i in range(batch)] if adapters else None
        t_short = self.generate_seconds(self.prompts(batch, input_len, input_len), short, lora)
        t_long = self.generate_seconds(self.prompts(batch, input_len, input_len), long, lora)
        step = max(t_long - t_short, 1e-9) / (long - short)
        floor, nbytes = self.floor_step_s(batch, input_len + (short + long) / 2)
        return {"batch": batch, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
                "of_roofline": floor / step, "bytes_per_step": nbytes, "tok_s": batch / step}

    def offline_throughput(self, num_prompts: int, input_len: tuple[int, int], output_len: int,
                           max_running: int) -> dict:
        prompts = self.prompts(num_prompts, *input_len)
        seconds = self.generate_seconds(prompts, output_len)
        batch = min(max_running, num_prompts)
        floor, _ = self.floor_step_s(batch, sum(input_len) / 2 + output_len / 2)
        tok_s = num_prompts * output_len / seconds
        return {"num_prompts": num_prompts, "input_len": list(input_len), "output_len": output_len,
                "seconds": seconds, "output_tok_s": tok_s, "ceiling_tok_s": batch / floor,
                "of_ceiling": tok_s * floor / batch}

    def verify_step(self, batch: int, context: int, row_tokens: int, steps: int = 20) -> dict:
        """Speculative decoding's ceiling: the device time of a step whose `batch` rows each
        verify `row_tokens` tokens (the last token and `row_tokens - 1` drafts, a sample row per
        token: the real verify program) against a plain decode step of the same rows, both at
        `context` cached tokens, run back to back through the engine's runner while the engine
        is idle (the KV written is garbage in pages nobody holds; disable_radix_cache keeps them
        out of any later prompt). verify_ms / decode_ms is what a verified row costs: a drafter
        whose rows keep `n` tokens on average speeds decoding up n / ratio times."""
        from xlaserve.runtime.executor.forward_batch import make_forward_batch
        from xlaserve.runtime.sampling.params import RowSamplingParams
        from xlaserve.runtime.sampling.params import build_sampling_metadata
        from xlaserve.runtime.executor.step_inputs import SAMPLING_WIDTHS
        from xlaserve.runtime.scheduler.request import SeqChunk

        core = self.engine.core
        runner, page_size = core.runner, core.runner.page_size
        pages_per_row = -(-(context + row_tokens) // page_size)
        times = {}
        for tokens in (1, row_tokens):
            chunks = [SeqChunk(list(range(3, 3 + tokens)), context,
                               list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)),
                               True, num_drafts=tokens - 1) for i in range(batch)]
            fb = make_forward_batch(chunks, core.buckets, page_size)
            rows = fb.num_sample_rows
            sampling = build_sampling_metadata([RowSamplingParams(temperature=0.0, seed=0)] * rows,
                                               rows, SAMPLING_WIDTHS)
            slots = np.zeros(fb.shape[1], np.int32)
            slots[:batch] = np.arange(1, batch + 1)
            jax.block_until_ready(runner.step(fb, sampling, slots).sample.tokens)  # warm
            start = time.perf_counter()
            for _ in range(steps):
                out = runner.step(fb, sampling, slots)
            jax.block_until_ready(out.sample.tokens)
            times[tokens] = (time.perf_counter() - start) / steps
        ratio = times[row_tokens] / times[1]
        return {"batch": batch, "context": context, "row_tokens": row_tokens,
                "decode_ms": times[1] * 1e3, "verify_ms": times[row_tokens] * 1e3,
                "verify_over_decode": ratio, "speedup_if_all_accepted": row_tokens / ratio}

    def server_flags(self) -> list[str]:
        """The launch_server flags of this engine's options."""
        flags = []
        for name, value in self.options.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                flags.append(flag)
            elif value is not False and value is not None:
                flags += [flag, str(value)]
        return flags

    def close(self) -> None:
        self.engine.shutdown()
        self.engine = None
        jax.clear_caches()  # the next model compiles its own programs; free these


# --- the server --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before /health")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        time.sleep(1)
    raise TimeoutError(f"no 200 from /health in {timeout_s:.0f} s")


def server_check(model_path: str, *, timeout_s: float, max_tokens: int = 8,
                 flags: list[str] | None = None) -> dict:
    """Launches `python -m xlaserve.launch_server` on dummy weights, waits for /health, sends
    one completion of a token-id prompt with the openai SDK; checks a 200 and every token.
    `flags`: the server's engine flags (ModelBench.server_flags, so that its steps load from
    the executable cache); default, a small engine of two step sizes. The result says how many
    serving steps the server loaded and compiled (its "Serving steps:" line)."""
    import openai

    from xlaserve.runtime.executor.buckets import max_step_tokens

    port, storage = free_port(), tempfile.mkdtemp(prefix="accelerator_check_")
    log_path = os.path.join(storage, "server.log")
    if flags is None:  # two programs to compile (8 tokens and the largest step)
        running, prefill = 8, 56
        flags = ["--load-format", "dummy", "--skip-tokenizer-init",
                 "--max-running-requests", str(running), "--max-prefill-tokens", str(prefill),
                 "--context-length", "256", "--max-total-tokens", "4096",
                 "--precompile-token-paddings", f"8,{max_step_tokens(running, prefill)}"]
    command = [sys.executable, "-m", "xlaserve.launch_server", "--model-path", model_path,
               "--port", str(port), *flags, "--file-storage-path", storage,
               "--log-level", "info"]
    # This process's JAX already holds most of the GPU (75% preallocated): the server takes a
    # slice, which its 4096-token KV pool and a small model fit in.
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.15",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=REPO_ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, process, timeout_s)
        ready_s = time.perf_counter() - start
        client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(
            model="default", prompt=[5, 6, 7, 8], max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True})
        reply = raw.parse()
        tokens = reply.usage.completion_tokens
        with open(log_path) as f:
            steps = re.search(r"Serving steps: (\d+) loaded, (\d+) compiled", f.read())
        return {"ready_s": ready_s, "status_code": raw.status_code, "completion_tokens": tokens,
                "finish_reason": reply.choices[0].finish_reason,
                "steps_loaded": int(steps[1]) if steps else None,
                "steps_compiled": int(steps[2]) if steps else None,
                "passed": raw.status_code == 200 and tokens == max_tokens}
    except Exception as error:
        with open(log_path) as f:
            error.add_note("server log tail:\n" + f.read()[-3000:])
        raise
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        if process.poll() is None:
            process.kill()
        shutil.rmtree(storage, ignore_errors=True)
