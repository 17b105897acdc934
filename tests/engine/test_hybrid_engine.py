"""Hybrid linear-attention models through the engine (issue 76: a tiny random Qwen3.5 text model,
tests/tiny_models.py): continuous batching with chunked prefill gives transformers' greedy tokens
and each request's solo ones, with nothing compiled after the precompile; more requests than
running slots, so later ones take the state slots of finished ones while others decode; 64
requests running at once; the prefix cache reuses prompts from their state snapshots
(scheduler/state_reuse.py): a shared prefix, a multi-turn chat (from the last answer's
snapshot), snapshots evicted past the pool;
on two devices (--tp-size 2) too;
speculative decoding (NGRAM, and NEXTN with the checkpoint's MTP layer on a tiny Qwen3-Next and
Qwen3.5) gives plain decoding's tokens, its verified rows' states rolled back to their accepted
drafts (executor/verified_rows.StateRollback); the flags whose state the linear layers do not
keep yet are refused by name. The checks: tests/engine/family_engine.py."""
import logging

import pytest

from tests.engine.family_engine import (GREEDY, check_batched_equal_solo_and_transformers,
                                        check_cached_prefix, check_two_devices, family_fixtures)
from tests.hf_reference import hf_greedy
from xlaserve.offline import Engine

# Six requests on four running slots, prompts of 1 to 40 tokens in prefill chunks of 7.
PROMPTS = [
    [5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91, 13, 200, 201, 7, 8] * 2 + [1, 2, 3, 4],
    [1, 2],
    [(11 * i) % 500 + 1 for i in range(26)],
    [99],
    [400 + i for i in range(17)],
    [99, 98, 97, 96, 95],
]
# Prompts that repeat themselves: the drafter proposes from the first output token on, and a
# random model's answers refuse most drafts.
REPEATING = [
    [5, 17, 300, 42, 9, 77, 5, 17, 300, 42, 9, 77, 5, 17],
    [7, 8, 7, 8, 7, 8, 7],
    [400, 401, 402, 403, 404, 405, 406, 400, 401, 402],
    [99, 98],
]
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=4,
             chunked_prefill_size=7, max_prefill_tokens=12, context_length=96,
             max_total_tokens=512)

checkpoint, engine = family_fixtures("qwen3_5", SMALL)


def test_batched_chunked_greedy_requests_equal_solo_runs_and_transformers(engine, checkpoint):
    check_batched_equal_solo_and_transformers(engine, checkpoint[1], PROMPTS, GREEDY)


def test_sixty_four_requests_at_once_each_in_its_own_state_slot(checkpoint):
    """64 running requests (slots 1..64), prompts of 1 to 33 tokens prefilled together in
    chunks and then decoded side by side, the step's rows padded to its buckets: each request's
    tokens are transformers' greedy ones."""
    prompts = [[(37 * i + 11 * j) % 500 + 1 for j in range(1 + i % 33)] for i in range(64)]
    new = 4
    with Engine(checkpoint[0], **dict(SMALL, max_running_requests=64, chunked_prefill_size=256,
                                      max_prefill_tokens=256, max_total_tokens=4096),
                disable_precompile=True) as wide:
        results = wide.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=new))
        assert wide.core.runner.state_slots > 64
    for prompt, result in zip(prompts, results, strict=True):
        assert result["output_ids"] == hf_greedy(checkpoint[1], prompt, new)


def test_a_prompt_reuses_a_cached_prefix_from_its_state_snapshot(engine, checkpoint):
    """Two prompts sharing 8 tokens: the first's state was snapshotted at its last whole page
    (8 tokens), so the second starts there, its linear layers from the snapshot."""
    check_cached_prefix(engine, checkpoint[1], GREEDY)


def test_a_multi_turn_chat_reuses_each_earlier_turn_with_transformers_tokens(engine, checkpoint):
    """Each turn's prompt is the last one, its answer and a new message: it starts from the last
    answer's last whole page (snapshotted as it decoded: 9 of its 10 tokens computed) and gives
    transformers' tokens for the whole conversation. Repeats of a turn reuse all but its last
    page (its own prompt's snapshot)."""
    engine.core.flush_cache()
    prompt, compiles = [(7 * i) % 500 + 1 for i in range(13)], engine.core.runner.compile_count()
    reused, new = 0, GREEDY["max_new_tokens"]
    for turn in range(3):
        result = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert result["output_ids"] == hf_greedy(checkpoint[1], prompt, new)
        assert result["meta_info"]["cached_tokens"] == reused, turn
        again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
        assert again["output_ids"] == result["output_ids"]
        assert again["meta_info"]["cached_tokens"] == (len(prompt) - 1) // 4 * 4
        reused = (len(prompt) + new - 1) // 4 * 4  # the answer's last whole page
        prompt = prompt + result["output_ids"] + [11 * turn + 3, 200, 201]
    assert engine.core.runner.compile_count() == compiles


def test_snapshots_over_the_pool_evict_the_least_recently_used_and_stay_exact(engine, checkpoint):
    """Six prompts of distinct prefixes on four snapshot slots, their answers too short to reach
    a page boundary (no decode snapshot): the first two prompts' snapshots are evicted (their
    pages may stay), so a repeat of the first runs from its start; a repeat of the last reuses
    its snapshot; both give transformers' tokens."""
    engine.core.flush_cache()
    prompts = [[100 + 10 * p + i for i in range(9)] for p in range(6)]
    short = dict(GREEDY, max_new_tokens=3)  # 11 tokens computed: none past the page at 8
    for prompt in prompts:
        engine.generate(input_ids=prompt, sampling_params=short)
    first = engine.generate(input_ids=prompts[0], sampling_params=short)
    last = engine.generate(input_ids=prompts[-1], sampling_params=short)
    assert [first["meta_info"]["cached_tokens"], last["meta_info"]["cached_tokens"]] == [0, 8]
    for prompt, result in ((prompts[0], first), (prompts[-1], last)):
        assert result["output_ids"] == hf_greedy(checkpoint[1], prompt, 3)


def test_a_tiny_page_pool_retracts_and_every_request_keeps_transformers_tokens(checkpoint,
                                                                               caplog):
    """A KV pool of 64 tokens for six requests: the newest are retracted (their states dropped
    with their slots) and run again from their prompts, or from a snapshot of them."""
    with Engine(checkpoint[0], **dict(SMALL, max_total_tokens=64),
                disable_precompile=True) as small:
        with caplog.at_level(logging.INFO):
            results = small.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert "Retract requests" in caplog.text
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result["output_ids"] == hf_greedy(checkpoint[1], prompt, GREEDY["max_new_tokens"])


def test_max_mamba_cache_size_bounds_the_snapshots(checkpoint):
    """--max-mamba-cache-size counts the running requests' state slots and the snapshots':
    fewer than the running requests is refused; as many leaves no snapshot, so nothing is
    reused."""
    with pytest.raises(ValueError, match="must hold the --max-running-requests 4"):
        Engine(checkpoint[0], **SMALL, max_mamba_cache_size=3)
    with Engine(checkpoint[0], **SMALL, max_mamba_cache_size=4, disable_precompile=True) as none:
        prompt = [5, 17, 300, 42, 9, 77, 120, 3, 250, 11]
        cached = [none.generate(input_ids=prompt, sampling_params=GREEDY)["meta_info"]
                  ["cached_tokens"] for _ in range(2)]
        assert cached == [0, 0] and none.core.runner.state_slots == 5


def test_tensor_parallel_engine_gives_transformers_greedy_tokens(checkpoint):
    """--tp-size 2: the full layer split by KV head, its MLPs by width, the linear layers and
    their states by head; with NGRAM drafts (all refused on these prompts: 4 verified rows),
    the verified rows' states, split by head, rolled back."""
    check_two_devices(checkpoint[0], checkpoint[1], REPEATING, dict(GREEDY, max_new_tokens=16),
                      dict(SMALL, tp_size=2, max_running_requests=16,
                           speculative_algorithm="NGRAM", speculative_num_draft_tokens=3))


def a_prompt_whose_first_draft_hits(hf_model, prompt: list[int], new: int = 40) -> list[int]:
    """`prompt` and the start of the model's greedy answer, cut where the answer goes on as it
    did after an earlier occurrence of its token: the NGRAM drafter's first draft there is
    accepted (a random model's answers rarely repeat by themselves)."""
    from xlaserve.runtime.scheduler.speculation import NgramIndex

    answer = hf_greedy(hf_model, prompt, new)
    for cut in range(1, new - 1):
        ids = prompt + answer[:cut + 1]  # the prompt, then the first token sampled
        if NgramIndex(1, 12).draft(ids, 3)[:1] == [answer[cut + 1]]:
            return prompt + answer[:cut]
    raise AssertionError("no answer token goes on as it did before: pick another prompt")


def test_speculative_decoding_rolls_verified_rows_back_to_transformers_tokens(checkpoint):
    check_speculation_rolls_back(checkpoint)


def check_speculation_rolls_back(checkpoint):
    """NGRAM drafts on four requests (a step with drafts holds at most 16 tokens), then on a
    prompt whose first draft is accepted: verified rows that keep all, some and none of their
    drafts, each state committed to its accepted tokens; every output is transformers' greedy
    one, with nothing compiled after the precompile. A chat turn after them reuses its prefix
    from a snapshot."""
    greedy = dict(GREEDY, max_new_tokens=16)
    options = dict(SMALL, max_running_requests=16, speculative_algorithm="NGRAM",
                   speculative_num_draft_tokens=4)
    hit = a_prompt_whose_first_draft_hits(checkpoint[1], REPEATING[0])
    with Engine(checkpoint[0], **options) as spec:
        compiles = spec.core.runner.compile_count()
        results = spec.generate(input_ids=REPEATING, sampling_params=greedy)
        results.append(spec.generate(input_ids=hit, sampling_params=greedy))  # drafts at once
        speculator = spec.core.scheduler.speculator
        verified, accepted = speculator.verified_rows, speculator.accepted_drafts
        again = spec.generate(input_ids=REPEATING[0] + [11, 12], sampling_params=greedy)
        assert spec.core.runner.compile_count() == compiles
    for prompt, result in zip(REPEATING + [hit], results, strict=True):
        assert result["output_ids"] == hf_greedy(checkpoint[1], prompt, 16)
    assert 0 < accepted < 3 * verified  # drafts accepted, and some refused
    assert again["meta_info"]["cached_tokens"] == 12
    assert again["output_ids"] == hf_greedy(checkpoint[1], REPEATING[0] + [11, 12], 16)


# The tiny models given an MTP layer: Qwen3-Next's experts with a shared one, and a dense
# Qwen3.5 whose LM head is its embedding (tied, as the small published ones).
MTP_FAMILIES = {"qwen3_next": {}, "qwen3_5": {"tie_word_embeddings": True}}


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """family -> (directory, transformers' model, the MTP layer's own tensors): a tiny model
    with its MTP layer (mtp.*: its decoder layer a copy of the last, full-attention, layer's; fc
    and the norms random), made once per module."""
    from tests.draft_head_models import add_qwen_mtp_layer
    from tests.tiny_models import make_tiny_checkpoint

    made = {}

    def get(family: str):
        if family not in made:
            directory = str(tmp_path_factory.mktemp(family + "_mtp"))
            model = make_tiny_checkpoint(directory, family, **MTP_FAMILIES[family])
            made[family] = directory, model, add_qwen_mtp_layer(directory)
        return made[family]

    return get


@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_nextn_drafts_with_the_mtp_layer_and_rolls_verified_rows_back(mtp_checkpoint, family):
    """--speculative-algorithm NEXTN on Qwen3-Next and Qwen3.5: every draft is the MTP layer's
    from scratch (transformers' hidden states and its own full-attention layer,
    tests/draft_head_models.py), and the output transformers' greedy tokens, batched with chunked
    prompts, nothing compiled after the precompile. A random MTP layer's drafts are refused, so
    two proposals in three are replaced by the plain decoding's next tokens (the last one spoiled
    in every other): verified rows keep all, some and none of their drafts, the linear layers'
    states rolled back and the head's cache caught up on what each keeps."""
    from tests.draft_head_models import QWEN_MTP, nextn_reference_drafts

    directory, model, own = mtp_checkpoint(family)
    prompts, greedy = PROMPTS[:4], dict(GREEDY, max_new_tokens=12)
    answers = {tuple(p): hf_greedy(model, p, 12) for p in prompts}
    options = dict(SMALL, max_running_requests=16, speculative_algorithm="NEXTN",
                   speculative_num_draft_tokens=3)
    proposals = []
    with Engine(directory, **options) as spec:
        compiles = spec.core.runner.compile_count()
        speculator = spec.core.scheduler.speculator
        propose = speculator.drafter

        def oracle(requests, rooms):
            drafts = propose(requests, rooms)
            out = []
            for r, draft in zip(requests, drafts):
                proposals.append((list(r.all_ids()), list(draft)))
                good = answers[tuple(r.prompt_ids)][len(r.output_ids):][:len(draft)]
                if len(proposals) % 6 == 1 and len(good) > 1:
                    good[-1] = (good[-1] + 1) % 512
                out.append(good if len(proposals) % 3 else draft)
            return out

        speculator.drafter = oracle
        results = spec.generate(input_ids=prompts, sampling_params=greedy)
        assert spec.core.runner.compile_count() == compiles
        assert speculator.verified_rows > 0 and speculator.accepted_drafts > 0
    assert [r["output_ids"] for r in results] == [answers[tuple(p)] for p in prompts]
    assert max(len(d) for _, d in proposals) == 2 and len(proposals) > 10
    for sequence, drafts in proposals:
        assert drafts == nextn_reference_drafts(model, own, sequence, len(drafts), QWEN_MTP), \
            len(sequence)


@pytest.mark.slow
def test_nextn_on_two_devices_gives_transformers_tokens(mtp_checkpoint):
    """--tp-size 2 with NEXTN on Qwen3-Next: the MTP layer's attention, experts and the model's
    LM head it drafts through split as the model's, the verified rows' states (split by head)
    rolled back; only the precompiled programs run. 90 s on 2 shared cores (2026-11-30): a
    process of its own precompiles the step and the head's draft steps for two devices."""
    directory, model, _ = mtp_checkpoint("qwen3_next")
    check_two_devices(directory, model, PROMPTS[:4], dict(GREEDY, max_new_tokens=8),
                      dict(SMALL, tp_size=2, max_running_requests=16,
                           speculative_algorithm="NEXTN", speculative_num_draft_tokens=3))


def test_nextn_needs_one_mtp_layer_in_the_checkpoint(checkpoint, mtp_checkpoint, tmp_path):
    """A checkpoint without mtp.* tensors, or with mtp_num_hidden_layers other than 1, stops
    start-up naming it."""
    import json
    import shutil

    with pytest.raises(ValueError, match=r"NEXTN: the checkpoint has no mtp\.\* tensors"):
        Engine(checkpoint[0], **SMALL, speculative_algorithm="NEXTN")
    shutil.copytree(mtp_checkpoint("qwen3_next")[0], tmp_path / "two")
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    (tmp_path / "two" / "config.json").write_text(json.dumps({**config,
                                                             "mtp_num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="NEXTN: mtp_num_hidden_layers is 2"):
        Engine(str(tmp_path / "two"), **SMALL, speculative_algorithm="NEXTN")


@pytest.mark.parametrize("flags,named", [
    (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="x"),
     "--speculative-algorithm EAGLE3"),
    (dict(speculative_algorithm="NEXTN", speculative_eagle_topk=2),
     "--speculative-eagle-topk 2"),
    (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
    (dict(enable_deterministic_inference=True), "--enable-deterministic-inference"),
])
def test_flags_the_linear_layers_do_not_keep_a_state_for_are_refused(checkpoint, flags, named):
    with pytest.raises(ValueError, match=f"{named}.* with a hybrid linear-attention model"):
        Engine(checkpoint[0], **SMALL, **flags)
