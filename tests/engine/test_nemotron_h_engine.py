"""Nemotron-H through the engine (issue 76: the tiny random one of tests/tiny_models.py, Mamba-2
layers with a state slot per request): batched, chunked greedy requests, more than the running
slots (mixed prefill and decode steps, slots handed on), give transformers' tokens and each
request's solo ones with nothing compiled after the precompile; a prompt reuses a cached prefix
from its state snapshot (scheduler/state_reuse.py); on two devices (--tp-size 2, the Mamba-2
layers split by group, the experts by width) too; speculative decoding (NGRAM) gives
transformers' tokens, its verified rows' scans rolled back to their accepted drafts. The checks:
tests/engine/family_engine.py, tests/engine/test_hybrid_engine.py."""
from tests.engine.family_engine import (GREEDY, check_batched_equal_solo_and_transformers,
                                        check_cached_prefix, check_two_devices, family_fixtures)
from tests.engine.test_hybrid_engine import PROMPTS, SMALL, check_speculation_rolls_back

checkpoint, engine = family_fixtures("nemotron_h", SMALL)


def test_batched_chunked_greedy_requests_equal_solo_runs_and_transformers(engine, checkpoint):
    check_batched_equal_solo_and_transformers(engine, checkpoint[1], PROMPTS, GREEDY)


def test_a_prompt_reuses_a_cached_prefix_from_its_state_snapshot(engine, checkpoint):
    """Two prompts sharing 8 tokens: the second starts from the first's snapshot at its last
    whole page (8 tokens), its Mamba-2 layers' conv windows and SSM states restored."""
    check_cached_prefix(engine, checkpoint[1], GREEDY)


def test_tensor_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2: the Mamba-2 layers and their states split by group (2 groups), attention by
    KV head, the MLPs by width."""
    check_two_devices(checkpoint[0], checkpoint[1], PROMPTS, GREEDY, dict(SMALL, tp_size=2))


def test_speculative_decoding_rolls_verified_rows_back_to_transformers_tokens(checkpoint):
    """Mamba2State.commit_accepted: the scan and the window of each verified row's kept
    tokens."""
    check_speculation_rolls_back(checkpoint)


def test_nextn_stops_start_up_naming_the_mtp_layer_it_lacks(checkpoint):
    """Nemotron-H has no multi-token-prediction layer: NEXTN (allowed for hybrids, whose
    Qwen3-Next and Qwen3.5 have one) is refused in one line."""
    import pytest

    from xlaserve.offline import Engine

    with pytest.raises(ValueError, match="NEXTN needs a DeepSeek-V3/R1 checkpoint"):
        Engine(checkpoint[0], **SMALL, speculative_algorithm="NEXTN")
