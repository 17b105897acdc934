"""The jitted step: forward + sampling over packed batches, precompile, compile warnings."""
import logging

import numpy as np
import pytest

from tests.greedy_driver import greedy_generate
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.runtime.executor.buckets import buckets_for_limits
from xlaserve.weights.loader import load_model
from xlaserve.runtime.executor.forward_batch import make_forward_batch
from xlaserve.runtime.scheduler.request import SeqChunk
from xlaserve.runtime.executor.model_runner import ModelRunner
from xlaserve.runtime.executor.step_inputs import SAMPLING_WIDTHS
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.sampling.params import build_sampling_metadata

PAGE_SIZE = 4
BUCKETS = buckets_for_limits(max_tokens_per_step=32, max_seqs=4, max_pages_per_seq=8,
                             page_paddings=[8])
PROMPTS = [[5, 17, 300, 42, 9, 77, 120], [1, 2, 3]]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qwen3"))
    make_tiny_checkpoint(directory, "qwen3")
    return load_model(directory, dtype="float32", skip_tokenizer_init=True, progress=False)


def _greedy_together(runner, prompts, new_tokens):
    """Both prompts prefilled in one step, then decoded together, pages 8 per sequence."""
    pages = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(prompts))]
    slots = np.arange(1, len(prompts) + 1, dtype=np.int32)
    for slot, prompt in zip(slots, prompts, strict=True):
        runner.assign_slots([(int(slot), prompt, ())])
    outputs = [[] for _ in prompts]
    chunks = [SeqChunk(list(p), 0, pages[i]) for i, p in enumerate(prompts)]
    for step in range(new_tokens):
        batch = make_forward_batch(chunks, BUCKETS, PAGE_SIZE)
        sampling = build_sampling_metadata(
            [RowSamplingParams(temperature=0.0, seed=0, sample_index=step)] * len(prompts),
            batch.shape[1], SAMPLING_WIDTHS)
        padded_slots = np.zeros(batch.shape[1], np.int32)
        padded_slots[:len(prompts)] = slots
        tokens = np.asarray(runner.step(batch, sampling, padded_slots).sample.tokens)
        for i in range(len(prompts)):
            outputs[i].append(int(tokens[i]))
        chunks = [SeqChunk([outputs[i][-1]], c.num_cached + len(c.token_ids), c.page_ids)
                  for i, c in enumerate(chunks)]
    return outputs


def test_batched_greedy_steps_equal_each_prompt_decoded_alone(loaded):
    runner = ModelRunner(loaded, num_pages=1 + 8 * len(PROMPTS), page_size=PAGE_SIZE,
                         max_running_requests=4)
    together = _greedy_together(runner, PROMPTS, 6)
    alone = [greedy_generate(loaded.model, p, 6, page_size=PAGE_SIZE) for p in PROMPTS]
    assert together == alone
    # Penalty state: each slot counted exactly the tokens it generated.
    counts = np.asarray(runner.output_counts)
    for slot, output in enumerate(together, start=1):
        assert counts[slot].sum() == len(output)
        assert all(counts[slot][t] == output.count(t) for t in output)
    assert counts[0].sum() == 0  # padding rows never count
    assert np.asarray(runner.prompt_masks)[1][PROMPTS[0]].all()


def test_no_compile_after_precompile_and_a_loud_warning_for_a_new_shape(loaded, caplog):
    runner = ModelRunner(loaded, num_pages=1 + 8 * len(PROMPTS), page_size=PAGE_SIZE,
                         max_running_requests=4)
    runner.precompile(BUCKETS.all_shapes(), progress=False, threads=2)  # 2 compiles at once
    compiled = runner.compile_count()
    assert compiled == len(BUCKETS.all_shapes())
    with caplog.at_level(logging.WARNING):
        _greedy_together(runner, PROMPTS, 3)
    assert runner.compile_count() == compiled
    assert "COMPILED WHILE SERVING" not in caplog.text
    # A page-table width outside the buckets compiles, and says so.
    odd = buckets_for_limits(32, 4, 8, page_paddings=[3])
    batch = make_forward_batch([SeqChunk([1, 2], 0, [1, 2, 3])], odd, PAGE_SIZE)
    with caplog.at_level(logging.WARNING):
        runner.step(batch, build_sampling_metadata([RowSamplingParams(seed=1)], batch.shape[1]),
                    np.array([1, 0, 0, 0], np.int32))
    assert runner.compile_count() == compiled + 1
    assert "COMPILED WHILE SERVING" in caplog.text and "(8, 4, 3)" in caplog.text
    # ... and so does a step whose sampling tables are not padded to the fixed widths.
    batch = make_forward_batch([SeqChunk([1, 2], 0, [1, 2])], BUCKETS, PAGE_SIZE)
    runner.step(batch, build_sampling_metadata([RowSamplingParams(seed=1)], batch.shape[1]),
                np.array([1, 0, 0, 0], np.int32))
    assert runner.compile_count() == compiled + 2


def test_the_step_updates_the_donated_kv_cache_in_place(loaded):
    # A pool much larger than anything else in the step. Where the attention loop read the
    # updated cache from outside the loop, XLA copied every layer's whole cache (seen at 1-token
    # steps whose page table needs several KV chunks): the copies show in the temporary memory.
    runner = ModelRunner(loaded, num_pages=16384, page_size=PAGE_SIZE, max_running_requests=4)
    layer_bytes = runner.kv_caches[0].nbytes  # 32 MiB; the step's own buffers are a few MiB
    for tokens, seqs, pages in [(1, 1, 64), (1, 1, 1024), (8, 4, 1024)]:
        stats = runner.compiled_step(tokens, seqs, pages).memory_analysis()
        assert stats.temp_size_in_bytes < layer_bytes / 2, (tokens, seqs, pages, stats.temp_size_in_bytes)


@pytest.mark.parametrize("matmul_backend,shapes", [("native", [(1, 1), (8, 8), (32, 8)]),
                                                   ("xla", [(8, 8), (32, 8)])])
def test_bfloat16_steps_never_convert_a_weight_to_float32(tmp_path, matmul_backend, shapes):
    # XLA's CPU backend converted whole bfloat16 weights to float32 every step when a dot's
    # output was bfloat16, or when the tied LM head was written with an explicit transpose. The
    # native GEMM widens bfloat16 in registers; XLA's 1-row bfloat16 dot does convert (the default
    # buckets skip 1-row steps there).
    import re

    import jax
    from flax import nnx

    from xlaserve.runtime.executor import kernels

    if matmul_backend == "native" and not kernels._gemm_builds():
        pytest.skip("the native CPU GEMM does not build here")
    make_tiny_checkpoint(str(tmp_path), "llama_tied_linear")
    loaded = load_model(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, progress=False)
    weight_shapes = {",".join(map(str, x.shape)) for x in jax.tree.leaves(nnx.state(loaded.model))
                     if x.ndim >= 2}
    runner = ModelRunner(loaded, num_pages=64, page_size=PAGE_SIZE, max_running_requests=8,
                         matmul_backend=matmul_backend)
    weight_shapes |= {",".join(map(str, x.shape)) for x in runner._weight_args if x.ndim >= 2}
    for tokens, seqs in shapes:
        text = runner.compiled_step(tokens, seqs, 8).as_text()
        entry = text[text.index("\nENTRY"):]  # buffers the step materializes (not fused code)
        converted = set(re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} (?:convert|fusion)\(", entry))
        assert not converted & weight_shapes, (tokens, converted & weight_shapes)


def test_cpu_weights_are_packed_for_the_native_kernels_unless_xla_dots_are_asked(tmp_path):
    import jax
    from flax import nnx

    from xlaserve.model.weight_types.packed import PackedMatrix
    from xlaserve.native import norm_cpu, swiglu_cpu
    from xlaserve.runtime.executor import kernels

    if not kernels._gemm_builds():
        pytest.skip("the native CPU GEMM does not build here")
    make_tiny_checkpoint(str(tmp_path), "llama_tied_linear")
    outputs = {}
    for backend in ("auto", "xla"):
        loaded = load_model(str(tmp_path), dtype="float32", skip_tokenizer_init=True, progress=False)
        runner = ModelRunner(loaded, num_pages=64, page_size=PAGE_SIZE, max_running_requests=4,
                             matmul_backend=backend)
        packed = isinstance(loaded.model.embedding.get_value(), PackedMatrix)
        assert packed == (backend == "auto") == (runner.kernels.packed_matmul is not None)
        # the norms and the MLP activation are native where the GEMM is (when they build)
        native_elementwise = packed and kernels._elementwise_builds()
        assert (runner.kernels.add_rms_norm is norm_cpu.add_rms_norm) == native_elementwise
        assert (runner.kernels.swiglu is swiglu_cpu.swiglu) == native_elementwise
        assert (runner.kernels.packed_matmul_swiglu is not None) == native_elementwise
        if packed:  # the layers' weights of one kind are views of one stack, one argument
            first, second = (layer.mlp.down.get_value() for layer in loaded.model.layers[:2])
            assert first.panels is second.panels and (first.layer, second.layer) == (0, 1)
            assert len(runner._weight_args) < len(jax.tree.leaves(nnx.state(loaded.model))) / 2
        outputs[backend] = greedy_generate(loaded.model, PROMPTS[0], 6, page_size=PAGE_SIZE)
    assert outputs["auto"] == outputs["xla"]
    with pytest.raises(ValueError, match="not one of"):
        kernels.kernels_for(matmul_backend="blas")


def test_many_admissions_set_the_same_slot_state_as_one_at_a_time(loaded):
    """assign_slots runs 8 rows a call (the last padded with null-slot rows), from two
    precompiled programs: the penalty state it leaves is what one call per request leaves."""
    vocab = loaded.config.vocab_size
    rng = np.random.default_rng(0)
    assignments = [(slot, rng.integers(0, vocab, 5).tolist(), rng.integers(0, vocab, 3).tolist())
                   for slot in range(1, 11)]  # 10: one full call of 8 and one padded
    together = ModelRunner(loaded, num_pages=8, page_size=4, max_running_requests=12)
    together.precompile([], progress=False)
    assert set(together._reset_programs) == {1, 8}
    together.assign_slots(assignments)
    alone = ModelRunner(loaded, num_pages=8, page_size=4, max_running_requests=12)
    for assignment in assignments:
        alone.assign_slots([assignment])
    np.testing.assert_array_equal(np.asarray(together.output_counts), np.asarray(alone.output_counts))
    np.testing.assert_array_equal(np.asarray(together.prompt_masks), np.asarray(alone.prompt_masks))
    assert np.asarray(together.output_counts)[0].sum() == 0  # the null slot stays zeros
    assert int(np.asarray(together.output_counts)[3].sum()) == 3


def test_page_table_writes_past_a_steps_room_go_first_and_an_unrun_step_writes_nothing(loaded):
    """The device page table (runtime/executor/page_table.py): a sequence of 1100 pages is more writes
    than a step carries (1024), so they go through `write_pages` before the step; a step staged
    and never run leaves the table as it was, and the next step's writes are against that."""
    runner = ModelRunner(loaded, num_pages=1200, page_size=PAGE_SIZE, max_running_requests=4,
                         context_length=8192)
    wide = buckets_for_limits(32, 4, 2048, page_paddings=[2048])
    long_pages = list(range(1, 1101))

    def staged(chunks, slots):
        batch = make_forward_batch(chunks, wide, PAGE_SIZE)
        padded = np.zeros(batch.shape[1], np.int32)
        padded[:len(slots)] = slots
        sampling = build_sampling_metadata([RowSamplingParams(seed=1)] * len(chunks),
                                           batch.shape[1], SAMPLING_WIDTHS)
        return runner.stage(batch, sampling, padded)

    step = staged([SeqChunk([7], 1099 * PAGE_SIZE, long_pages)], [1])
    assert step.overflow_writes is not None and len(step.overflow_writes[0]) == 1100
    runner.run(step).sample.tokens.block_until_ready()
    never_run = staged([SeqChunk([7], 0, [1101, 1102])], [2])
    assert never_run.overflow_writes is None
    runner.run(staged([SeqChunk([7, 8, 9, 10, 11], 0, [1101, 1103])], [2]))
    table = np.asarray(runner.page_table.array)
    np.testing.assert_array_equal(table[1, :1100], long_pages)
    np.testing.assert_array_equal(table[2, :2], [1101, 1103])
    assert (table[1, 1100:] == 0).all() and (table[2, 2:] == 0).all() and (table[0] == 0).all()
    np.testing.assert_array_equal(runner.page_table.rows.table(), table)
