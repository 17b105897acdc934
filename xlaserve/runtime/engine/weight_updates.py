"""An RL trainer's control of the engine (SGLang's names): new weights while serving
(`update_from_disk`, `update` from a trainer's arrays), the device memory released and resumed
(tags `weights`, `kv_cache`), generation paused and continued, and the weights' version.

Everything that touches the device state runs on the engine loop between steps, once no step
is in flight: a job pauses the scheduler, and runs at the loop's next turn (the turn that
paused it scheduled nothing and read the step before). New weights are loaded and checked in
the caller's thread while serving goes on; the swap itself is a list assignment
(runtime/executor/weight_swap.py), with no compile. An update either waits for the running
requests to end on the old weights (admitting none meanwhile; the queue runs on the new ones:
SGLang's default, which holds requests in flight through the update) or, with
`abort_all_requests`, aborts every request first.

Released weights come back from a host copy with --enable-weights-cpu-backup; without it they
come back as zeros and generation stays paused until an update fills them, so they are never
served (SGLang would serve whatever the memory held).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any, Callable

import jax
from flax import nnx

from xlaserve.runtime.engine.messages import OnLoop, settle
from xlaserve.runtime.executor import WeightMismatch
from xlaserve.server_args.platform_defaults import device_memory
from xlaserve.runtime.scheduler import retract_running
from xlaserve.weights import (TensorBuckets, WeightError, load_model, model_from_state,
                              model_from_tensors, server_load_options)

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")
PAUSE_MODES = ("abort", "retract", "in_place")


class WeightUpdateError(ValueError):
    """An update or memory call refused: nothing changed (the old weights serve on)."""


def _one_at_a_time(method):
    """Control calls run one after another (an update reads the served weights' specs,
    which a release changes). After each, the garbage collector runs: a model built for an
    update holds reference cycles (NNX's graph), so its arrays left over (the leaves before
    packing, a refused model's) would hold device memory until the collector next ran, which
    Python times by object counts, not bytes (measured: a tiny model's copy stayed until the
    next update)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._control:
            try:
                return method(self, *args, **kwargs)
            finally:
                gc.collect()
    return run


@dataclasses.dataclass
class _Job:
    run: Callable[[], Any]
    done: Future
    drain: bool  # waits for the running requests to end first
    quiet_since: int | None = None  # the loop turn that paused the scheduler for it


class WeightUpdates:
    def __init__(self, runner, scheduler, live_requests, loaded, args, wait, wake):
        """`wait(message)`: puts an inbox message and waits for its `done` (EngineCore._wait);
        `wake()`: ends the loop's wait on an empty inbox. The owner sets `hooks` once the step
        pipeline is built (an embedding server's has none: every call is refused)."""
        self._runner, self._scheduler, self._live = runner, scheduler, live_requests
        self._loaded, self._args = loaded, args
        self._wait, self._wake = wait, wake
        self.version: str = args.weight_version
        self._jobs: list[_Job] = []
        self._turn = 0
        self._paused_by_user = False
        self._released: set[str] = set()
        self._weights_missing = False  # released without a backup, not yet updated
        self._control = threading.Lock()
        self._buckets = TensorBuckets()  # named tensors sent in several calls
        self._served_from = loaded.source  # the checkpoint the served weights came from
        # The step pipeline's between_steps hooks (steps.py; None: an embedding server's):
        # `between_steps` is one of them only while a job waits, off a plain request's path.
        self.hooks: list | None = None

    # --- any thread ---------------------------------------------------------------------------

    def refusal(self, update: bool = True) -> str | None:
        """Why this server's weights cannot be updated (not `update`: its memory released or
        its generation paused), or None."""
        if self.hooks is None:  # an embedding server's steps (PooledSteps) take no hooks
            return "an embedding server's weights and memory are not updated or released"
        if self._runner.sink.replays:
            return "the RL calls over several hosts (--nnodes > 1) are not built"
        if not update:
            return None
        if self._loaded.config.vision is not None:
            return ("weight updates of an image model's vision tower are not built: serve it "
                    "for text with --limit-mm-per-prompt '{\"image\": 0}'")
        if self._runner.draft_head_pool is not None:
            return "weight updates beside a speculative draft head (EAGLE3, NEXTN) are not built"
        return None

    @_one_at_a_time
    def update_from_disk(self, model_path: str, load_format: str | None = None, **options) -> int:
        """Serves the weights of the checkpoint at `model_path` (a local directory or file, in
        any format the loader reads), loaded here as the served ones were (dtype,
        quantization, sharding); returns the requests paused meanwhile (SGLang's
        `num_paused_requests`: those left waiting). `options`: `_swap`'s."""
        self._check()
        if load_format not in (None, "auto"):
            raise WeightUpdateError(f"load_format {load_format!r}: the loader reads the format "
                                    "from the path (safetensors, GGUF, an xlaserve checkpoint)")
        if not model_path or not os.path.exists(model_path):
            raise WeightUpdateError(f"model_path {model_path!r}: not a file or directory on "
                                    "the server (hub ids are not fetched here)")
        load = server_load_options(self._args) | {"model_path": model_path, "load_format": "auto"}
        try:
            new = load_model(**load, mesh=self._runner.mesh, skip_tokenizer_init=True,
                             progress=False)
        except (OSError, ValueError) as error:
            failure = f"{model_path}: {error}"  # raised below: no cycle through this frame
        else:
            _check_config(new.config, self._loaded.config)
            paused = self._swap(new.model, **options)
            self._served_from = new.source  # what later buckets are completed against
            self._buckets.clear()
            return paused
        raise WeightUpdateError(failure)

    @_one_at_a_time
    def update_named(self, tensors: dict, **options) -> str:
        """Serves named tensors (Hugging Face names: torch, NumPy or JAX arrays), all at once
        or in buckets over several calls (held until complete: TensorBuckets); returns what
        is still awaited ("" once the update is done)."""
        self._check()
        try:
            complete, awaited = self._buckets.add(self._loaded.config, self._served_from,
                                                  tensors)
        except WeightError as error:
            failure = str(error)
        else:
            if complete is not None:
                self._update(complete, **options)
            return awaited
        raise WeightUpdateError(failure)

    @_one_at_a_time
    def update(self, params, **options) -> int:
        """Serves `params`: an NNX state (or module) of xlaserve's model, or {Hugging Face
        name: tensor} of every weight of the checkpoint (torch, NumPy or JAX arrays)."""
        return self._update(params, **options)

    def _update(self, params, **options) -> int:
        self._check()
        config, served = self._loaded.config, self._loaded
        where = dict(dtype=served.dtype, mesh=self._runner.mesh,
                     quantization=self._args.quantization)
        if isinstance(params, dict) and all(isinstance(k, str) for k in params):
            build = model_from_tensors
        elif isinstance(params, (nnx.State, nnx.Module)):
            build = model_from_state
        else:
            raise WeightUpdateError(f"update weights from an nnx.State or a dict of named "
                                    f"tensors, not {type(params).__name__}")
        try:
            model = build(config, params, **where)
        except WeightError as error:
            # Raised outside the handler: a traceback cycle through this frame would keep the
            # arrays placed so far alive until the garbage collector ran.
            failure = str(error)
        else:
            return self._swap(model, **options)
        raise WeightUpdateError(failure)

    def _swap(self, model, *, abort_all_requests: bool = False, flush_cache: bool = True,
              weight_version: str | None = None, is_async: bool = False,
              keep_pause: bool = False) -> int:
        """Swaps in `model`'s weights once the running requests end (`is_async`: at once,
        their next tokens from the new weights; `abort_all_requests`: aborted first), then
        empties the prefix cache (`flush_cache`) and pauses generation (`keep_pause`)."""
        try:
            args = self._runner.weights.arguments_of(model)
        except WeightMismatch as error:
            failure = f"not the served model's weights: {error}"
        else:
            return self._queue_swap(args, abort_all_requests, flush_cache, weight_version,
                                    is_async, keep_pause)
        raise WeightUpdateError(failure)

    def _queue_swap(self, args, abort_all_requests, flush_cache, weight_version, is_async,
                    keep_pause) -> int:

        def swap():
            self._runner.weights.replace(args)
            self._weights_missing = False
            self._paused_by_user |= keep_pause
            if weight_version is not None:
                self._set_version(weight_version)
            if flush_cache:
                self._scheduler.flush_cache()
            return self._scheduler.num_waiting

        message = "aborted: the server's weights are being updated (abort_all_requests)"
        return self._queue(swap, drain=not (abort_all_requests or is_async),
                           abort=message if abort_all_requests else None)

    @_one_at_a_time
    def pause(self, mode: str = "abort") -> None:
        """SGLang's pause_generation: `abort` ends every request; `retract` takes the running
        ones back to the queue (their KV dropped, recomputed on continue); `in_place` keeps
        them where they are. No step runs until `resume_generation`."""
        self._check(update=False)
        if mode not in PAUSE_MODES:
            raise WeightUpdateError(f"mode {mode!r}: one of {', '.join(PAUSE_MODES)}")

        def paused():
            self._paused_by_user = True
            if mode == "retract":
                retract_running(self._scheduler)

        self._queue(paused, drain=False,
                    abort="aborted: generation was paused (mode abort)" if mode == "abort" else None)

    def resume_generation(self) -> None:
        """SGLang's continue_generation."""
        self._check(update=False)

        def go():
            if self._weights_missing:
                raise WeightUpdateError("the weights were released without a host backup "
                                        "(--enable-weights-cpu-backup): update them first")
            self._paused_by_user = False
            self._settle()
        self._wait(OnLoop(lambda: settle(done, go), done := Future()))

    @_one_at_a_time
    def release(self, tags: list[str] | None = None, backup: bool | None = None) -> dict:
        """Frees the device memory of `tags` (default both); generation pauses until they are
        resumed (a running request keeps its place unless its KV cache goes: then it is
        retracted). `backup`: keep the weights' values on the host (default
        --enable-weights-cpu-backup). Returns the devices' bytes in use before and after."""
        self._check(update=False)
        tags = _tags(tags)
        backup = self._args.enable_weights_cpu_backup if backup is None else backup

        def release():
            before = bytes_in_use(self._runner.mesh)
            if "kv_cache" in tags:
                retract_running(self._scheduler)
                self._scheduler.flush_cache()
                self._runner.release_kv_caches()
            if "weights" in tags:
                self._runner.weights.release(backup)
            self._released |= set(tags)
            after = bytes_in_use(self._runner.mesh)
            logger.info("Released %s: %.2f GB in use on the devices, from %.2f GB",
                        " and ".join(tags), after / 1e9, before / 1e9)
            return {"bytes_before": before, "bytes_after": after}

        return self._queue(release, drain=False)

    @_one_at_a_time
    def resume(self, tags: list[str] | None = None) -> None:
        """Re-makes the memory of `tags` (default both): the KV pool zeroed, the weights from
        their host backup (or zeros: generation then waits for an update)."""
        self._check(update=False)
        tags = _tags(tags)

        def resume():
            if "kv_cache" in tags:
                self._runner.resume_kv_caches()
            if "weights" in tags and not self._runner.weights.resume():
                self._weights_missing = True
                logger.info("Resumed the weights' memory without their values (no "
                            "--enable-weights-cpu-backup): generation waits for an update")
            self._released -= set(tags)

        self._queue(resume, drain=False)

    def set_version(self, version: str, abort_all_requests: bool = True) -> None:
        """SGLang's update_weight_version."""
        self._check(update=False)

        def change():
            if abort_all_requests:
                self._live.abort_many(self._live.rids(), "aborted: the weight version changed")
            self._set_version(version)
        self._wait(OnLoop(lambda: settle(done, change), done := Future()))

    def sleeping(self) -> bool:
        """vLLM's is_sleeping: some memory is released."""
        return bool(self._released)

    def weight(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of the served weight at `name` (a path of
        `leaf_names`), as the step takes it."""
        self._check(update=False)

        def read():
            try:
                return self._runner.weights.named(name, truncate_size).tolist()
            except ValueError as error:  # too many values asked for
                raise WeightUpdateError(str(error)) from None
            except KeyError:
                example = self._runner.weights.leaf_names()[0]
                raise WeightUpdateError(f"no served weight is named {name!r} (names are the "
                                        f"model's parameter paths, e.g. {example!r})") from None
        return self._wait(OnLoop(lambda: settle(done, read), done := Future()))

    def _check(self, update: bool = True) -> None:
        if (why := self.refusal(update)) is not None:
            raise WeightUpdateError(why)

    def _queue(self, run, drain: bool, abort: str | None = None):
        """Runs `run` on the loop once no step is in flight (after the running requests end,
        with `drain`; after aborting every request, with `abort`); returns its result."""
        job = _Job(run, Future(), drain)

        def queue():
            if abort is not None:
                self._live.abort_many(self._live.rids(), abort)
            self._jobs.append(job)
            if self.between_steps not in self.hooks:
                self.hooks.append(self.between_steps)  # last: it may take itself out
            if drain:
                self._scheduler.admitting = False
            else:
                self._quiet(job)
        return self._wait(OnLoop(queue, job.done))

    # --- the loop thread ----------------------------------------------------------------------

    def between_steps(self) -> None:
        """Each loop turn: runs the first job once a turn has passed with the scheduler
        paused for it."""
        self._turn += 1
        while self._jobs:
            job = self._jobs[0]
            if job.quiet_since is None:
                if (job.drain and self._scheduler.num_running and not self._paused_by_user
                        and not self._released):
                    return  # they end on the old weights (paused in place: they stay)
                self._quiet(job)
                self._wake()  # this turn ends now, not after the inbox's wait
                return
            if self._turn <= job.quiet_since:
                return
            self._jobs.pop(0)
            settle(job.done, job.run)
            self._settle()
        self.hooks.remove(self.between_steps)  # the last hook: the loop over them ends here

    def _quiet(self, job: _Job) -> None:
        self._scheduler.paused = True
        job.quiet_since = self._turn

    def _settle(self) -> None:
        """The scheduler's pause and admission from what holds them."""
        self._scheduler.admitting = not any(j.drain for j in self._jobs)
        self._scheduler.paused = bool(
            self._paused_by_user or self._released or self._weights_missing
            or any(j.quiet_since is not None for j in self._jobs))

    def _set_version(self, version: str) -> None:
        self.version = version
        for request in self._scheduler.requests.values():  # their next tokens are the new one's
            request.weight_version = version


def _tags(tags: list[str] | None) -> list[str]:
    tags = list(TAGS) if tags is None else list(tags)
    if not tags or any(t not in TAGS for t in tags):
        raise WeightUpdateError(f"tags {tags}: a list of {' and '.join(TAGS)}")
    return tags


def _check_config(new, served) -> None:
    """WeightUpdateError naming the first field where a checkpoint's config differs from the
    served model's (another architecture, size or shape)."""
    if new == served:
        return
    for field in dataclasses.fields(served):
        if getattr(new, field.name) != getattr(served, field.name):
            raise WeightUpdateError(
                f"the checkpoint's {field.name} is {str(getattr(new, field.name))[:80]}, the "
                f"served model's {str(getattr(served, field.name))[:80]}: only weights of the "
                f"served architecture and shapes can be updated")
    raise WeightUpdateError("the checkpoint's config differs from the served model's")


def bytes_in_use(mesh) -> int:
    """Bytes in use on `mesh`'s devices: the platform's figure where it has one (TPU, GPU),
    else the live arrays' bytes there (the CPU has no memory statistics)."""
    devices = set(mesh.devices.flat)
    memory = [device_memory(d) for d in devices]
    if all(m is not None for m in memory):
        return sum(in_use for _, in_use in memory)
    return sum(shard.data.nbytes for array in jax.live_arrays() if not array.is_deleted()
               for shard in array.addressable_shards if shard.device in devices)
