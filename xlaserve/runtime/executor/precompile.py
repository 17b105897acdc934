"""ModelRunner.precompile's work: the serving step compiled before serving, one program per bucket
shape (tokens, seqs, pages) and program variant (ModelRunner.program_variants), and the warning
logged for a step compiled afterwards, with its shape, because a compile while serving stalls
every request for seconds.

In one process each program is compiled, not run (a run of each with padding rows cost ~1.3 s of
the default model's start), one at a time or several (--precompile-threads: each lowered in turn,
then compiled on threads, which XLA does without the GIL; on a 2-core AMD EPYC two threads took
the default model's 10 programs 33.4 s against 24.6 s for one, as XLA's CPU compiler has threads
of its own: `benchmarks/bench_startup.py --modes cold --xlaserve-arg=--precompile-threads=2`;
a GPU host's is to be measured), or loaded from the executable cache
(runtime/compile/executable_cache.py; the loads on threads): `compile_steps`. On TPU the first one
is compiled with the weights' layouts left to XLA, and the weights are then stored in the layouts
it chose, which the jitted step and every other program take (`choose_weight_layouts`); with
--disable-precompile the weights keep the default ones. Over several processes each step runs
instead, on every process alike, and the followers compile it as they replay it
(`run_idle_steps`).

These are functions of a ModelRunner (runtime/executor/model_runner.py, which calls them): they
read its jitted steps and lowering arguments, and `choose_weight_layouts` replaces its weights.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os

import jax
from tqdm.auto import tqdm

from xlaserve.runtime.compile.executable_cache import ExecutableCache, compile_on_threads
from xlaserve.runtime.executor.step_inputs import idle_step
from xlaserve.runtime.executor.weight_args import abstract_args, stored_in, weight_formats
from xlaserve.runtime.sampling.step_needs import StepNeeds

logger = logging.getLogger(__name__)


def compile_steps(runner, keys, cache: ExecutableCache | None, progress: bool,
                  threads: int = 1) -> dict:
    """{(shape, needs, tree width): its program} for each ((tokens, seqs, pages) shape, tree
    width) of `keys` and program variant: loaded from `cache`, or compiled (and stored there),
    `threads` programs at a time. The first one chooses the weights' layouts when the runner is
    to (`choose_weight_layouts`)."""
    shapes = [(tuple(shape), needs, tree) for shape, tree in keys
              for needs in runner.program_variants()]
    found = {}
    if runner._choosing_step is not None:  # first: the other programs keep the layouts chosen
        found[shapes[0]] = choose_weight_layouts(runner, *shapes[0], cache)
    lowering = {shape: runner._lowering_args(*shape) for shape in shapes if shape not in found}
    if cache is not None:
        paths = {shape: cache.path(*lowering[shape], name="serving step",
                                   description=runner._description) for shape in lowering}
        devices = list(runner.mesh.devices.flat)  # the mesh's order is jit's device assignment

        def load(shape):
            return cache.load(paths[shape], devices)

        with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
            found.update(zip(lowering, pool.map(load, lowering)))
    missing = [shape for shape in lowering if found.get(shape) is None]
    step = runner._step
    with tqdm(total=len(missing), desc="Precompiling", unit="shape",
              disable=not progress) as bar:
        if cache is None:
            lowered = [step.lower(*lowering[shape][0], **lowering[shape][1]) for shape in missing]
            compiled = compile_on_threads(lowered, threads, bar.update)
        else:
            compiled = cache.compile_and_store_all(step, [lowering[shape] for shape in missing],
                                                   [paths[shape] for shape in missing], threads,
                                                   bar.update)
    found.update(zip(missing, compiled))
    return {shape: found[shape] for shape in shapes}


def choose_weight_layouts(runner, shape, needs: StepNeeds | None, tree_width: int,
                          cache: ExecutableCache | None):
    """The program of one bucket shape and variant with the weights' layouts left to XLA
    (compiled, or loaded from `cache`), after which the runner's weights are stored in the
    layouts it chose, which the jitted step and every other program then take: no weight is
    relaid out in a step (on TPU v6e the default layouts cost 64 a step,
    weight_args.auto_formats). Not another compile: the program serves its bucket. The model's
    own arrays are freed."""
    logger.info("Choosing the weights' layouts: the step of shape %s, %s", shape, needs)
    args, kwargs = runner._lowering_args(shape, needs, tree_width)
    # Layout.AUTO takes shapes: an array has a layout already.
    args = (abstract_args(args[0]), *args[1:])
    if cache is None:
        compiled = runner._choosing_step.lower(*args, **kwargs).compile()
    else:
        path = cache.path(args, kwargs, name="serving step, weight layouts chosen",
                          description=runner._description)
        compiled = (cache.load(path, list(runner.mesh.devices.flat)) or
                    cache.compile_and_store(runner._choosing_step, args, kwargs, path))
    runner._weight_args = stored_in(runner._weight_args, weight_formats(compiled))
    runner._choosing_step = None
    return compiled


def run_idle_steps(runner, keys, progress: bool) -> None:
    """Multi-host: a step runs on every process, so the followers compile it as they replay it.
    An idle step of each (shape, tree width) and program variant goes through the jitted step
    (`run`), on every process alike."""
    variants = runner.program_variants()
    for shape, tree in tqdm(keys, desc="Precompiling", unit="shape", disable=not progress):
        for needs in variants:
            staged = dataclasses.replace(
                runner.stage(*idle_step(*shape, runner.sample_rows(shape), tree)), needs=needs)
            jax.block_until_ready(runner.run(staged).sample.tokens)


def warn_compiled_while_serving(shape, widths, needs: StepNeeds | None,
                                tree_width: int = 0) -> None:
    """What ModelRunner.run logs when the jitted step compiled a program after `precompile`."""
    logger.warning(
        "COMPILED WHILE SERVING: a step of shape (tokens, seqs, pages)=%s, logit-bias "
        "width %d, suppressed width %d, needs %s, tree width %d was not precompiled; every "
        "request waited for it. Add the shape to the padding buckets.", shape, *widths, needs,
        tree_width)
