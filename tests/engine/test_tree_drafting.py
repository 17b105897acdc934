"""Tree drafting (--speculative-eagle-topk > 1) end to end on a tiny Llama with a random EAGLE-3
head: every tree the head drafts holds the likeliest nodes of the beam a from-scratch PyTorch
reference computes (tests/draft_head_models.py), and every output, greedy or seeded sampled,
equals plain decoding's, also when the path the target keeps is not the tree's first branch:
its KV (the target's and the head's) must have moved to the path's positions; and sampled
tokens from tree rows follow the model's distribution (a chi-square test).

A random head's drafts almost never match the target, so an oracle rebuilds each tree after
recording it: the plain decoding's next tokens on the second branch of the root, beside a wrong
first branch with a child of its own, the last good node spoiled on every other tree."""
import numpy as np
import pytest

from tests.draft_head_models import eagle3_reference_beam
from tests.engine.test_draft_heads import deepseek, head, plain, target  # noqa: F401 - fixtures
from tests.engine.test_speculative_decoding import SMALL
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.runtime.scheduler.speculation import DraftTree


PROMPTS = [[5, 17, 300, 42, 9, 77, 5], [7, 8, 7, 8, 7, 8, 7, 8, 7, 8, 7], [400, 401, 402]]
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
TOPK, STEPS, TOKENS = 2, 3, 5  # a beam of 2 paths 3 deep; its 4 likeliest nodes verified


@pytest.fixture(scope="module")
def tree(target, head):
    with Engine(target[0], speculative_algorithm="EAGLE3", speculative_draft_model_path=head[0],
                speculative_eagle_topk=TOPK, speculative_num_steps=STEPS,
                speculative_num_draft_tokens=TOKENS, **SMALL) as engine:
        yield engine


def oracle_tree(answer: list[int], room: int, spoil: bool) -> DraftTree:
    """The answer's next tokens as the root's second branch, after a wrong first branch (with a
    child): the kept path's nodes sit at row offsets 2, 4, ... before the step moves them."""
    good = list(answer[:max(room - 2, 1)])
    if spoil and len(good) > 1:
        good[-1] = (good[-1] + 1) % 512
    wrong = (good[0] + 7) % 512
    tokens, parents = [wrong, good[0]], [0, 0]
    if room > 2:
        tokens.append((wrong + 1) % 512)
        parents.append(1)
    at = 2  # the row index of the good path's last node
    for token in good[1:]:
        tokens.append(token)
        parents.append(at)
        at = len(tokens)
    return DraftTree(tokens[:room], parents[:room])


@pytest.fixture
def oracle(monkeypatch, tree):
    class Oracle:
        answers: dict = {}
        proposals: list = []

    propose = tree.core.scheduler.speculator.drafter

    def recorded(requests, rooms):
        drafts = propose(requests, rooms)
        replaced = []
        for r, room, draft in zip(requests, rooms, drafts):
            Oracle.proposals.append((list(r.all_ids()), draft, room))
            answer = Oracle.answers.get(tuple(r.prompt_ids))
            done = len(r.output_ids)
            if answer is None or not draft or room < 2 or len(answer) - done < 2:
                replaced.append(draft)
                continue
            replaced.append(oracle_tree(answer[done:], room, len(Oracle.proposals) % 2 == 1))
        return replaced

    monkeypatch.setattr(tree.core.scheduler.speculator, "drafter", recorded)
    return Oracle


def ids(results):
    return [r["output_ids"] for r in results]


def paths(draft: DraftTree) -> set[tuple[int, ...]]:
    out, rows = set(), [()]
    for token, parent in zip(draft.tokens, draft.parents):
        rows.append(rows[parent] + (token,))
        out.add(rows[-1])
    return out


def test_the_oracle_tree_puts_the_answer_on_the_second_branch():
    tree = oracle_tree([10, 11, 12, 13], 4, spoil=False)
    assert (tree.tokens, tree.parents) == ([17, 10, 18, 11], [0, 0, 1, 2])
    assert paths(tree) == {(17,), (10,), (17, 18), (10, 11)}


def test_greedy_output_equals_plain_and_every_tree_is_the_reference_beams_likeliest(
        plain, tree, target, head, oracle):
    want = plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    oracle.answers = {tuple(p): w["output_ids"] for p, w in zip(PROMPTS, want)}
    got = tree.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert ids(got) == ids(want)
    accept = [r["meta_info"]["spec_accept_length"] for r in got]
    assert max(accept) > 2, accept  # second-branch paths were kept: their KV moved
    assert len(oracle.proposals) > 8
    for sequence, draft, room in oracle.proposals[:12]:
        if not draft:
            continue
        beam = eagle3_reference_beam(target[1], head[1], sequence, TOPK, STEPS)
        likeliest = sorted(beam, key=lambda node: -node[1])[:room]
        assert paths(draft) == {path for path, _ in likeliest}, len(sequence)
        assert len({p[0] for p in paths(draft) if len(p) == 1}) == len(
            [p for p in paths(draft) if len(p) == 1])


@pytest.mark.parametrize("seed", [1, 2])
def test_seeded_sampled_and_penalized_output_equals_plain_decoding(plain, tree, oracle, seed):
    params = [{"temperature": 0.6, "top_k": 4, "seed": seed, "max_new_tokens": 14,
               "ignore_eos": True},
              {"temperature": 1.0, "top_p": 0.8, "seed": seed + 10, "max_new_tokens": 14,
               "ignore_eos": True, "frequency_penalty": 1.0},
              {**GREEDY, "repetition_penalty": 1.5, "max_new_tokens": 14}]
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    oracle.answers = {tuple(p): w["output_ids"] for p, w in zip(PROMPTS, want)}
    assert ids(tree.generate(input_ids=PROMPTS, sampling_params=params)) == ids(want)


def test_no_compile_while_serving_and_pages_come_back(tree, oracle):
    compiled = tree.core.runner.compile_count()
    first = tree.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    again = tree.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert ids(again) == ids(first)
    assert tree.core.runner.compile_count() == compiled
    assert tree.core.scheduler.token_usage() == 0
    assert tree.core.scheduler.speculator.verified_rows > 0
    assert np.isfinite(tree.core.runner.kv_caches[0]).all()


@pytest.mark.parametrize("family", ["mistral", "llama4"])
def test_a_sliding_window_or_chunked_model_with_tree_drafting_stops_start_up(tmp_path, head,
                                                                             family):
    """A tree row's attention has no sliding window and no attention chunk (Llama 4): such a
    model drafts chains."""
    make_tiny_checkpoint(str(tmp_path / family), family)
    with pytest.raises(ValueError, match="tree drafting takes no sliding-window, chunked"):
        Engine(str(tmp_path / family), speculative_algorithm="EAGLE3",
               speculative_draft_model_path=head[0], speculative_eagle_topk=2, **SMALL)


def test_sampled_tokens_from_tree_rows_follow_the_models_distribution(target, tree, monkeypatch):
    """The statistical check: the first 3 tokens sampled (temperature 1, top_k 3: a 3-token
    vocabulary per position) by 640 seeded requests, whose 2nd and 3rd come from tree rows that
    hold the model's two likeliest next tokens under the root and the likeliest after the first
    (so either branch, and a path of two, is kept); the joint frequencies of the 27 outcomes
    against transformers' probabilities, by a chi-square test at p = 0.001 (fixed seeds: the
    outcome is deterministic; 18.3 against 55.6 at 27 degrees of freedom when written, with
    705 drafts kept)."""
    import torch

    model = target[1]
    prompt = [5, 17, 300, 42, 9]

    def next_probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        top = torch.topk(logits, 3)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    def oracle(requests, rooms):
        trees = []
        for r, room in zip(requests, rooms):
            ids = list(r.all_ids())
            first, second = sorted(next_probs(ids).items(), key=lambda kv: -kv[1])[:2]
            after = max(next_probs(ids + [first[0]]).items(), key=lambda kv: kv[1])[0]
            trees.append(DraftTree([first[0], second[0], after], [0, 0, 1]).cut(room))
        return trees

    monkeypatch.setattr(tree.core.scheduler.speculator, "drafter", oracle)
    counts: dict = {}
    # 4 at a time: all admitted at once, then every decode drafts (a step with drafts holds at
    # most max_running_requests, 16, tokens: 4 rows of 4).
    for batch in range(160):
        params = [{"temperature": 1.0, "top_k": 3, "seed": 1000 + 4 * batch + i,
                   "max_new_tokens": 5, "ignore_eos": True} for i in range(4)]
        for out in tree.generate(input_ids=[prompt] * 4, sampling_params=params):
            key = tuple(out["output_ids"][:3])
            counts[key] = counts.get(key, 0) + 1
    assert tree.core.scheduler.speculator.accepted_drafts > 300  # the trees' nodes were kept
    expected = {}
    for a, pa in next_probs(prompt).items():
        for b, pb in next_probs(prompt + [a]).items():
            for c, pc in next_probs(prompt + [a, b]).items():
                expected[(a, b, c)] = 640 * pa * pb * pc
    assert set(counts) <= set(expected), set(counts) - set(expected)
    # Cells expected under 5 times pooled into one, as a chi-square test wants.
    rare = [k for k, e in expected.items() if e < 5]
    cells = [(counts.get(k, 0), e) for k, e in expected.items() if k not in rare]
    cells.append((sum(counts.get(k, 0) for k in rare), sum(expected[k] for k in rare)))
    statistic = sum((n - e) ** 2 / e for n, e in cells if e > 0)
    df = len(cells) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # p = 0.001
    assert statistic < critical, (statistic, critical, counts)


def test_nextn_trees_are_the_mtp_layers_beam_and_outputs_equal_transformers(deepseek):
    """NEXTN (a tiny DeepSeek-V3 with its MTP layer) drafting trees: the model's and the MTP
    layer's tree rows run latent attention's absorbed form with tree masks; every tree holds the
    likeliest nodes of the layer's beam from scratch, and the output with oracle trees (the
    answer on the second branch) is transformers' greedy."""
    from tests.draft_head_models import nextn_reference_beam
    from tests.engine.test_draft_heads import DEEPSEEK
    from tests.hf_reference import hf_greedy

    directory, model, own = deepseek
    prompts = [[5, 17, 300, 42, 9, 77, 5, 60, 61, 62], [7, 8], [400, 401, 402]]
    want = [hf_greedy(model, p, GREEDY["max_new_tokens"]) for p in prompts]
    answers = {tuple(p): w for p, w in zip(prompts, want)}
    proposals = []
    with Engine(directory, speculative_algorithm="NEXTN", speculative_eagle_topk=2,
                speculative_num_steps=2, speculative_num_draft_tokens=4, **DEEPSEEK) as engine:
        propose = engine.core.scheduler.speculator.drafter

        def recorded(requests, rooms):
            drafts = propose(requests, rooms)
            out = []
            for r, room, draft in zip(requests, rooms, drafts):
                proposals.append((list(r.all_ids()), draft, room))
                rest = answers[tuple(r.prompt_ids)][len(r.output_ids):]
                out.append(oracle_tree(rest, room, spoil=False)
                           if draft and room >= 2 and len(rest) >= 2 else draft)
            return out

        engine.core.scheduler.speculator.drafter = recorded
        compiled = engine.core.runner.compile_count()
        assert ids(engine.generate(input_ids=prompts, sampling_params=GREEDY)) == want
        assert engine.core.scheduler.speculator.accepted_drafts > 0
        assert engine.core.runner.compile_count() == compiled
    assert len(proposals) > 8
    for sequence, draft, room in proposals[:10]:
        if draft:
            beam = nextn_reference_beam(model, own, sequence, 2, 2)
            assert paths(draft) == {p for p, _ in sorted(beam, key=lambda n: -n[1])[:room]}
