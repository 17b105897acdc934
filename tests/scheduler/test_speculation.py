"""Speculative decoding's host side (runtime/scheduler/speculation.py): the NGRAM drafter, the
acceptance rule, and the scheduler's verified rows (pages, stops, lengths), driven by the fake
model, whose token after any prefix is what a plain step would give."""
import pytest

from tests.scheduler.fake_model import PAGE, FakeModel, make_scheduler, outputs, req
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.scheduler.page_allocator import pages_for_tokens
from xlaserve.runtime.scheduler.scheduler import NoSpeculation
from xlaserve.runtime.scheduler.speculation import (NgramIndex, SpeculativeConfig, Speculator,
                                                    accepted)
from xlaserve.server_args import ServerArgs


def test_ngram_drafts_what_followed_the_longest_latest_match():
    index = NgramIndex(min_match=1, max_match=4)
    #        0  1  2  3  4  5  6  7  8  9
    ids = [1, 2, 3, 9, 8, 2, 3, 7, 5, 2, 3]
    # "2 3" occurs at 1-2 (then 9) and 5-6 (then 7); "X 2 3" matches neither longer: the latest
    assert index.draft(ids, 3) == [7, 5, 2]
    ids = [1, 2, 3, 9, 8, 2, 3, 7, 5, 1, 2, 3]  # "1 2 3" matches at 0-2: longer beats later
    assert NgramIndex(1, 4).draft(ids, 2) == [9, 8]
    assert NgramIndex(4, 4).draft(ids, 2) == []  # no run of 4 matches
    assert NgramIndex(1, 4).draft([4, 5, 6], 3) == []  # the last token never occurred before
    assert NgramIndex(1, 4).draft([5, 6, 5], 3) == [6, 5]  # cut at the ids' end
    assert NgramIndex(1, 4).draft(ids, 0) == []


def test_the_ngram_index_grows_with_the_request():
    index = NgramIndex(1, 3)
    ids = [10, 11, 12]
    assert index.draft(ids, 2) == []
    ids += [10]
    assert index.draft(ids, 2) == [11, 12]
    ids += [11, 12, 13, 10, 11]
    assert index.draft(ids, 3) == [12, 13, 10]  # "10 11" latest at 3-4, its "12 13 10"


def test_acceptance_keeps_tokens_up_to_the_first_that_differs_from_its_draft():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 4  # all drafts and the bonus token
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == 2  # 4, then 9 in place of 5
    assert accepted([4, 5, 6], [8, 5, 6, 7]) == 1  # the model's own token only


def test_greedy_outputs_with_speculation_equal_those_without():
    prompts = {"copy": [60, 61, 62, 63, 64, 65, 60, 61], "plain": [70, 71]}

    def run(speculation):
        s = make_scheduler(speculator=Speculator(speculation) if speculation else NoSpeculation())
        for rid, prompt in prompts.items():
            s.add(req(rid, max_new=24, prompt=prompt))
        model = FakeModel(s)
        return outputs(model.run_all()), model

    plain, _ = run(None)
    spec, model = run(SpeculativeConfig(num_draft_tokens=4))
    assert spec == plain
    assert any(c.num_drafts for b in model.batches for c in b.chunks)
    assert model.scheduler.num_pages_in_use == 0


def test_a_verified_row_accepts_the_agreeing_drafts_and_gives_back_the_rest_of_its_pages():
    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)))
    # The model will say 1 2 3 4 50 ...; the prompt makes the drafter propose 1 2 3 9 after 0.
    script = {"r": [0, 1, 2, 3, 50, 51, 52, 53, 54, 55]}
    s.add(req("r", max_new=10, prompt=[0, 1, 2, 3, 9, 7]))
    r = s.requests["r"]
    model = FakeModel(s, script)
    model.run_step()  # the prompt: samples 0
    batch = s.schedule()
    [chunk] = batch.chunks
    assert chunk.token_ids == [0, 1, 2, 3, 9] and chunk.num_drafts == 4
    assert len(chunk.page_ids) == pages_for_tokens(6 + 5, PAGE)
    s.process_results(batch, model.step(batch))
    assert r.output_ids == [0, 1, 2, 3, 50]  # 3 drafts accepted, then the model's 50
    assert r.num_computed == 6 + 4  # the last token and the 3 accepted drafts
    assert len(r.page_ids) == pages_for_tokens(r.num_computed + 1, PAGE)
    assert (r.speculation.verify_ct, r.speculation.accepted_drafts) == (1, 3)
    model.run_all()
    assert r.output_ids == script["r"] and s.num_pages_in_use == 0


@pytest.mark.parametrize("stop_at", [1, 2, 3])
def test_a_stop_id_inside_the_accepted_drafts_ends_the_request_there(stop_at):
    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)))
    script = {"r": [0, 1, 2, 3, 4, 5, 6, 7]}
    s.add(req("r", max_new=8, prompt=[0, 1, 2, 3, 4, 9], stop_token_ids=frozenset({stop_at})))
    finished = FakeModel(s, script).run_all()
    assert outputs(finished)["r"] == (script["r"][:stop_at + 1], ("stop", stop_at))
    assert s.num_pages_in_use == 0


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 5])
def test_drafts_never_take_a_request_past_max_new_tokens(max_new):
    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)))
    script = {"r": [0, 1, 2, 3, 4, 5, 6, 7]}
    s.add(req("r", max_new=max_new, prompt=[0, 1, 2, 3, 4, 9]))
    model = FakeModel(s, script)
    finished = model.run_all()
    assert outputs(finished)["r"] == (script["r"][:max_new], ("length", None))
    assert all(len(c.token_ids) <= max_new for b in model.batches[1:] for c in b.chunks)


def test_penalized_rows_speculate_too():
    """Their counts take the drafts before each token in the step (executor/verified_rows.py)."""
    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=4)))
    s.add(req("a", max_new=9, prompt=[5, 6, 7, 5, 6, 7]))
    s.add(req("b", max_new=9, prompt=[5, 6, 7, 5, 6, 7],
              sampling=RowSamplingParams(frequency_penalty=0.5)))
    model = FakeModel(s, {"a": [5, 6, 7] * 3, "b": [5, 6, 7] * 3})
    while not all(r.is_decoding for r in s.requests.values()):  # b waits to share a's prompt
        model.run_step()
    batch = s.schedule()
    drafts = {r.rid: c.num_drafts for r, c in zip(batch.requests, batch.chunks)}
    assert drafts["a"] > 0 and drafts["b"] > 0


def test_speculation_stops_above_its_batch_size_and_reads_each_step_while_on():
    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=4, max_batch=1)))
    s.add(req("a", max_new=10))
    model = FakeModel(s)
    model.run_step()
    assert s.speculator.speculating(s.num_running)
    assert s.schedule_continuation(model.batches[-1]) is None  # drafts need the step's tokens
    s.add(req("b", max_new=10))
    model.run_step()
    assert not s.speculator.speculating(s.num_running)
    batch = s.schedule()
    assert not any(c.num_drafts for c in batch.chunks)


def test_overlapped_loop_with_speculation_gives_the_same_outputs():
    def run(speculation):
        s = make_scheduler(speculator=Speculator(speculation) if speculation else NoSpeculation())
        for i in range(5):
            s.add(req(f"r{i}", prompt_len=3 + i, max_new=15))
        return outputs(FakeModel(s).run_overlapped())

    assert run(SpeculativeConfig(num_draft_tokens=3)) == run(None)


def test_vllm_speculative_config_and_sglangs_eagle_flags_map_onto_ours_and_bad_ones_stop_start_up():
    args = ServerArgs(model_path="m", speculative_config=(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5, "disable_by_batch_size": 8}'))
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("NGRAM", 4)
    assert (args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size) == (2, 5)
    assert SpeculativeConfig.from_server_args(args).max_batch == 8
    assert ServerArgs(model_path="m", speculative_algorithm="NGRAM").speculative_num_draft_tokens == 5
    draft = ServerArgs(model_path="m", speculative_config=(
        '{"method": "draft_model", "model": "small", "num_speculative_tokens": 2}'))
    assert (draft.speculative_algorithm, draft.speculative_draft_model_path,
            draft.speculative_num_draft_tokens) == ("STANDALONE", "small", 3)
    eagle = ServerArgs(model_path="m", speculative_algorithm="EAGLE",
                       speculative_draft_model_path="head", speculative_num_steps=3,
                       speculative_eagle_topk=1)
    assert (eagle.speculative_algorithm, eagle.speculative_num_draft_tokens) == ("EAGLE3", 4)
    mtp = ServerArgs(model_path="m", speculative_config='{"method": "deepseek_mtp"}')
    assert (mtp.speculative_algorithm, mtp.speculative_num_draft_tokens) == ("NEXTN", 5)
    qwen = ServerArgs(model_path="m", speculative_config=(
        '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'))
    assert (qwen.speculative_algorithm, qwen.speculative_num_draft_tokens) == ("NEXTN", 3)
    tree = ServerArgs(model_path="m", speculative_algorithm="EAGLE3",
                      speculative_draft_model_path="head", speculative_eagle_topk=4)
    assert (tree.speculative_num_steps, tree.speculative_num_draft_tokens) == (3, 13)
    tree = ServerArgs(model_path="m", speculative_algorithm="EAGLE3",
                      speculative_draft_model_path="head", speculative_eagle_topk=8,
                      speculative_num_steps=4, speculative_num_draft_tokens=16)
    assert tree.speculative_num_draft_tokens == 16
    eagle3 = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "head"}
    for bad, words in [({"speculative_algorithm": "EAGLE3"}, "need it"),
                       ({"speculative_algorithm": "NEXTN", "speculative_draft_model_path": "d"},
                        "NEXTN reads the model's own checkpoint"),
                       ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4},
                        "go with --speculative-algorithm EAGLE3 or NEXTN"),
                       ({**eagle3, "speculative_eagle_topk": 8, "speculative_num_steps": 5},
                        "must be 1 to 32"),
                       ({**eagle3, "speculative_eagle_topk": 2, "speculative_num_steps": 3,
                         "speculative_num_draft_tokens": 8}, "verifies 2 to 7 tokens"),
                       ({**eagle3, "speculative_eagle_topk": 0}, "1 or more"),
                       ({"speculative_algorithm": "NEXTN", "speculative_num_steps": 3,
                         "speculative_num_draft_tokens": 8}, "makes rows of 4 tokens"),
                       ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 3},
                        "go with --speculative-algorithm EAGLE3 or NEXTN"),
                       ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1},
                        "2 or more"),
                       ({"speculative_config": '{"method": "ngram", "draft_model": "x"}'},
                        "draft_model not supported"),
                       ({"speculative_algorithm": "NGRAM",
                         "speculative_ngram_min_match_window_size": 3,
                         "speculative_ngram_max_match_window_size": 2}, "min <= max"),
                       ({"speculative_algorithm": "STANDALONE"}, "need it"),
                       ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "d"},
                        "goes with"),
]:
        with pytest.raises(ValueError, match=words):
            ServerArgs(model_path="m", **bad)


def test_a_row_that_keeps_no_draft_backs_off_and_decodes_overlapped_meanwhile():
    """A rejected draft costs a verified row's extra tokens and the overlap: a request whose
    drafts fail waits 2, 4, ... tokens before it drafts again (one draft then), and the
    continuation flows meanwhile; one whose drafts all pass drafts one more next time."""
    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)))
    # The prompt proposes 1 2 3 4 after 0; the model says 0, then 5 6 7 ... (never a draft).
    script = {"r": [0] + list(range(5, 40))}
    s.add(req("r", max_new=30, prompt=[0, 1, 2, 3, 4, 9]))
    r = s.requests["r"]
    model = FakeModel(s, script)
    model.run_step()  # the prompt: samples 0
    batch = s.schedule()
    assert batch.chunks[0].num_drafts == 4
    s.process_results(batch, model.step(batch))
    assert r.output_ids == [0, 5] and (r.speculation.misses, r.speculation.draft_limit) == (1, 1)
    assert r.speculation.next_try == len(r.output_ids) + 2
    batch = s.schedule()  # backing off: a plain decode row, which a continuation may follow
    assert batch.chunks[0].num_drafts == 0
    assert s.schedule_continuation(batch) is not None


def test_a_row_that_keeps_every_draft_drafts_one_more_next_time():
    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)))
    script = {"r": [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]}
    s.add(req("r", max_new=15, prompt=[0, 1, 2, 0, 1, 2]))
    r = s.requests["r"]
    r.speculation.draft_limit = 2
    model = FakeModel(s, script)
    model.run_step()
    batch = s.schedule()
    assert batch.chunks[0].num_drafts == 2
    s.process_results(batch, model.step(batch))
    assert r.speculation.draft_limit == 3


def test_no_continuation_follows_a_verified_row_even_when_nothing_drafts_next():
    """A verified row's tokens are the host's to accept (the device does not write the slot's
    last token): a request whose last draft (one token from the end) is in flight and whose next
    step drafts nothing must still be read before that step is scheduled."""
    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)))
    script = {"r": [0, 1, 7, 8]}
    s.add(req("r", max_new=3, prompt=[0, 1, 2, 3, 4, 9]))
    model = FakeModel(s, script)
    model.run_step()  # samples 0
    batch = s.schedule()
    assert batch.chunks[0].num_drafts == 1  # 1 (from the prompt): max_new leaves room for one
    model.step(batch)
    assert s.schedule_continuation(batch) is None


def test_a_step_that_runs_prompt_tokens_drafts_nothing_and_drafts_fit_the_step():
    """Verified rows never share a step with a prompt, and a step's tokens stay within
    max_running_requests (the sample rows every bucket has: forward_batch.sample_rows_for)."""
    s = make_scheduler(max_running=4, speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)))
    script = {rid: [0, 1, 2, 3, 4] * 6 for rid in ("a", "b")}
    for rid in ("a", "b"):
        s.add(req(rid, max_new=20, prompt=[0, 1, 2, 3, 4, {"a": 9, "b": 8}[rid]]))
    model = FakeModel(s, script)
    model.run_all()
    for batch in model.batches:
        drafts = sum(c.num_drafts for c in batch.chunks)
        if drafts:
            assert batch.kind == "decode"
            assert sum(len(c.token_ids) for c in batch.chunks) <= 4
    assert any(c.num_drafts for b in model.batches for c in b.chunks)


def test_a_request_backing_off_tries_again_only_when_a_step_is_read_or_after_16_overlapped():
    """Its wait is over, but its try would cost the batch an overlapped step: it waits for a
    step read first anyway, or for PROBE_EVERY overlapped steps in a row."""
    from xlaserve.runtime.scheduler.speculation import PROBE_EVERY

    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)))
    s.add(req("r", prompt_len=6, max_new=60))
    model = FakeModel(s)
    model.run_step()
    r = s.requests["r"]
    # due from the next token on
    r.speculation.misses, r.speculation.next_try = 1, len(r.output_ids) + 1
    batch = s.schedule()
    assert batch.chunks[0].num_drafts == 0
    in_flight, overlapped = (batch, model.step(batch)), 0
    while (following := s.schedule_continuation(in_flight[0])) is not None:
        overlapped += 1
        s.process_results(*in_flight)
        in_flight = (following, model.step(following))
    assert overlapped == PROBE_EVERY


def test_the_decode_batch_line_gives_the_accept_length(caplog):
    """SGLang's `accept len` in the `Decode batch.` line, from the verified rows of the interval."""
    import logging

    s = make_scheduler(speculator=Speculator(SpeculativeConfig(num_draft_tokens=5)), log_interval=4)
    script = {"r": [0, 1, 2, 3, 4] * 8}
    s.add(req("r", max_new=40, prompt=[0, 1, 2, 3, 4, 9]))
    with caplog.at_level(logging.INFO):
        FakeModel(s, script).run_all()
    lines = [r.getMessage() for r in caplog.records if "Decode batch." in r.getMessage()]
    assert lines and all("accept len: " in line for line in lines), lines
    assert float(lines[0].split("accept len: ")[1].split(",")[0]) > 1


def test_a_draft_tree_drops_stop_ids_with_their_subtrees_and_gives_its_likeliest_chain():
    from xlaserve.runtime.scheduler.request import SeqChunk
    from xlaserve.runtime.scheduler.speculation import DraftTree, constrained, row_depths

    # Root's children 6 (likeliest) and 7; 8 under 6, 9 under 7, 4 under 8.
    tree = DraftTree([6, 7, 8, 9, 4], [0, 0, 1, 2, 3])
    assert tree.first_path() == [6, 8, 4]
    assert tree.without({8}.__contains__) == DraftTree([6, 7, 9], [0, 0, 2])
    assert tree.without({6}.__contains__) == DraftTree([7, 9], [0, 1])
    assert tree.cut(3) == DraftTree([6, 7, 8], [0, 0, 1]) and len(tree) == 5
    request = req("a", stop_token_ids={9})
    assert constrained(request, tree) == DraftTree([6, 7, 8, 4], [0, 0, 1, 3])

    class Grammar:  # takes the first two tokens of any draft
        def valid_prefix(self, draft):
            return min(len(draft), 2)

    request.grammar = Grammar()  # a grammar's masks follow one chain: the likeliest
    assert constrained(request, tree) == [6, 8]
    chunk = SeqChunk([5, *tree.tokens], 2, [1], num_drafts=5, tree_parents=[-1, *tree.parents])
    assert row_depths(chunk) == [0, 1, 1, 2, 2, 3]
    assert row_depths(SeqChunk([5, 6, 7], 2, [1], num_drafts=2)) == [0, 1, 2]
