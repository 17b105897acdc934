"""Speculative decoding with a draft head (EAGLE3: a random EAGLE-3 head on a tiny Llama) end to
end: every output equals plain decoding's, and every draft the head makes is what the head
computes from scratch for the request's sequence (tests/draft_head_models.py, PyTorch and
transformers' hidden states), also after verified rows that kept some drafts and rejected
others, whose head cache the step must have written for the kept tokens only.

A random head's drafts almost never match the target, so the rows here verify drafts an oracle
puts in (the plain decoding's next tokens, some spoiled) after recording the head's own: that
way rows keep 0, some or all of their drafts."""
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.draft_head_models import eagle3_reference_drafts, make_eagle3_head
from tests.engine.test_speculative_decoding import SMALL
from tests.hf_reference import hf_greedy
from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine


PROMPTS = [[5, 17, 300, 42, 9, 77, 5], [7, 8, 7, 8, 7, 8, 7, 8, 7, 8, 7], [400, 401, 402],
           [99, 98]]
GREEDY = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
# SMALL (test_speculative_decoding's engine options): chunks of 8 tokens, so the 11-token prompt
# runs in two (the head reads the prompt's next token at the first chunk's end).


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    # 4 layers: the head reads the outputs of layers 0, 1 and 2 (the inputs of 1, 2 and 3).
    return directory, make_tiny_checkpoint(directory, "llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(tmp_path_factory, target):
    directory = str(tmp_path_factory.mktemp("eagle3"))
    return directory, make_eagle3_head(directory, target[0])


@pytest.fixture(scope="module")
def plain(target):
    with Engine(target[0], **SMALL) as engine:
        yield engine


@pytest.fixture(scope="module")
def eagle(target, head):
    with Engine(target[0], speculative_algorithm="EAGLE3", speculative_draft_model_path=head[0],
                speculative_num_steps=3, speculative_eagle_topk=1, **SMALL) as engine:
        yield engine


@pytest.fixture
def oracle(monkeypatch, eagle):
    """Records each proposal (the request's sequence, the head's drafts) and replaces the drafts
    with `oracle.answers[prompt]`'s next tokens, the third one spoiled on every other proposal."""
    class Oracle:
        answers: dict = {}
        proposals: list = []

    propose = eagle.core.scheduler.speculator.drafter  # DraftHead.propose, bound at start-up

    def recorded(requests, rooms):
        drafts = propose(requests, rooms)
        replaced = []
        for r, draft in zip(requests, drafts):
            Oracle.proposals.append((list(r.all_ids()), list(draft)))
            answer = Oracle.answers.get(tuple(r.prompt_ids))
            if answer is None:
                replaced.append(draft)
                continue
            done = len(r.output_ids)
            good = list(answer[done:done + len(draft)])
            if len(Oracle.proposals) % 2 and len(good) > 2:
                good[2] = (good[2] + 1) % 512
            replaced.append(good)
        return replaced

    monkeypatch.setattr(eagle.core.scheduler.speculator, "drafter", recorded)
    return Oracle


def ids(results):
    return [r["output_ids"] for r in results]


def test_greedy_output_equals_plain_and_every_draft_is_the_heads_from_scratch(
        plain, eagle, target, head, oracle):
    want = plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    oracle.answers = {tuple(p): w["output_ids"] for p, w in zip(PROMPTS, want)}
    got = eagle.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert ids(got) == ids(want)
    accept = [r["meta_info"]["spec_accept_length"] for r in got]
    assert max(accept) > 2, accept  # rows kept drafts: the head caught up on them
    assert len(oracle.proposals) > 10
    assert max(len(drafts) for _, drafts in oracle.proposals) == 3  # the chain ran
    for sequence, drafts in oracle.proposals:
        assert drafts == eagle3_reference_drafts(target[1], head[1], sequence, len(drafts)), \
            len(sequence)


@pytest.mark.parametrize("seed", [1, 2])
def test_seeded_sampled_and_penalized_output_equals_plain_decoding(plain, eagle, oracle, seed):
    params = [{"temperature": 0.6, "top_k": 4, "seed": seed, "max_new_tokens": 16,
               "ignore_eos": True},
              {"temperature": 1.0, "top_p": 0.8, "seed": seed + 10, "max_new_tokens": 16,
               "ignore_eos": True, "frequency_penalty": 1.0},
              {**GREEDY, "repetition_penalty": 1.5, "max_new_tokens": 16},
              {"temperature": 0.8, "seed": seed + 30, "max_new_tokens": 16, "ignore_eos": True}]
    want = plain.generate(input_ids=PROMPTS, sampling_params=params)
    oracle.answers = {tuple(p): w["output_ids"] for p, w in zip(PROMPTS, want)}
    assert ids(eagle.generate(input_ids=PROMPTS, sampling_params=params)) == ids(want)


def test_no_compile_while_serving_and_pages_come_back(eagle):
    compiled = eagle.core.runner.compile_count()
    first = eagle.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    again = eagle.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # prompts from the cache
    assert ids(again) == ids(first)
    assert eagle.core.runner.compile_count() == compiled
    assert eagle.core.scheduler.token_usage() == 0
    assert eagle.core.scheduler.speculator.verified_rows > 0


TENSOR_PARALLEL_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from xlaserve.offline import Engine

    assert len(jax.devices()) == 2, jax.devices()
    target, head, prompts, greedy, small = json.loads(sys.argv[1])
    with Engine(target, tp_size=2, speculative_algorithm="EAGLE3",
                speculative_draft_model_path=head, speculative_num_draft_tokens=4,
                **small) as engine:
        propose, proposals = engine.core.scheduler.speculator.drafter, []

        def recorded(requests, rooms):
            drafts = propose(requests, rooms)
            proposals.extend((list(r.all_ids()), d) for r, d in zip(requests, drafts))
            return drafts

        engine.core.scheduler.speculator.drafter = recorded
        compiles = engine.core.runner.compile_count()
        out = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert engine.core.runner.compile_count() == compiles, "compiled while serving"
    print(json.dumps([[o["output_ids"] for o in out], proposals[:12]]))
""")


def test_tensor_parallel_heads_drafts_and_outputs_are_one_devices(plain, target, head):
    """--tp-size 2 on two CPU devices: the head's attention, MLP and LM head split as the
    model's; its drafts are the from-scratch reference's and the output plain decoding's. Over
    20 s: a process with two CPU devices starts JAX and precompiles the target's and the head's
    tensor-parallel steps."""
    result = subprocess.run(
        [sys.executable, "-c", TENSOR_PARALLEL_SCRIPT,
         json.dumps([target[0], head[0], PROMPTS, GREEDY, SMALL])], capture_output=True,
        text=True, timeout=600,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
             "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error"})
    assert result.returncode == 0, result.stderr[-4000:]
    outputs, proposals = json.loads(result.stdout.strip().splitlines()[-1])
    assert outputs == ids(plain.generate(input_ids=PROMPTS, sampling_params=GREEDY))
    assert max(len(d) for _, d in proposals) == 3
    for sequence, drafts in proposals:
        assert drafts == eagle3_reference_drafts(target[1], head[1], sequence, len(drafts))


def test_a_head_that_is_not_eagle3_or_a_pickle_stops_start_up(target, head, tmp_path):
    import shutil

    other = tmp_path / "eagle2"
    shutil.copytree(head[0], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config,
                                                   "architectures": ["LlamaForCausalLMEagle"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle.*not an EAGLE-3 head"):
        Engine(target[0], speculative_algorithm="EAGLE", speculative_draft_model_path=str(other),
               **SMALL)
    pickle = tmp_path / "pickle"
    pickle.mkdir()
    (pickle / "config.json").write_text(json.dumps(config))
    (pickle / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin: PyTorch pickles are not read"):
        Engine(target[0], speculative_algorithm="EAGLE3",
               speculative_draft_model_path=str(pickle), **SMALL)
    np.testing.assert_array_equal(head[1]["tensors"]["d2t"].shape, [384])


# --- NEXTN: DeepSeek-V3's own multi-token-prediction layer ------------------------------------

DEEPSEEK = dict(dtype="float32", skip_tokenizer_init=True, max_total_tokens=512,
                max_running_requests=8, chunked_prefill_size=8, max_prefill_tokens=8,
                context_length=96)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from tests.draft_head_models import add_nextn_layer

    directory = str(tmp_path_factory.mktemp("deepseek_v3"))
    model = make_tiny_checkpoint(directory, "deepseek_v3")
    return directory, model, add_nextn_layer(directory, model)


def test_nextn_output_equals_transformers_and_every_draft_is_the_mtp_layers_from_scratch(
        deepseek):
    from tests.draft_head_models import nextn_reference_drafts

    directory, model, own = deepseek
    prompts = [[5, 17, 300, 42, 9, 77, 5, 60, 61, 62], [7, 8], [400, 401, 402]]
    want = [hf_greedy(model, p, GREEDY["max_new_tokens"]) for p in prompts]  # plain decoding's
    answers = {tuple(p): w for p, w in zip(prompts, want)}
    proposals = []
    with Engine(directory, speculative_algorithm="NEXTN", speculative_num_draft_tokens=3,
                **DEEPSEEK) as engine:
        propose = engine.core.scheduler.speculator.drafter

        def recorded(requests, rooms):  # the plain decoding's next tokens, after recording
            drafts = propose(requests, rooms)
            proposals.extend((list(r.all_ids()), d) for r, d in zip(requests, drafts))
            return [answers[tuple(r.prompt_ids)][len(r.output_ids):][:len(d)]
                    if (len(proposals) + i) % 3 else d for i, (r, d) in enumerate(zip(requests, drafts))]

        engine.core.scheduler.speculator.drafter = recorded
        got = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert ids(got) == want
        assert engine.core.scheduler.speculator.accepted_drafts > 0
    assert max(len(d) for _, d in proposals) == 2 and len(proposals) > 10
    for sequence, drafts in proposals:
        assert drafts == nextn_reference_drafts(model, own, sequence, len(drafts)), len(sequence)


def test_nextn_needs_the_checkpoints_mtp_layer(target):
    with pytest.raises(ValueError, match="NEXTN needs a DeepSeek-V3/R1 checkpoint"):
        Engine(target[0], speculative_algorithm="NEXTN", **SMALL)
