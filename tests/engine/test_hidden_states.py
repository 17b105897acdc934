"""SGLang's return_hidden_states through the offline Engine (--enable-return-hidden-states,
runtime/engine/hidden_states.py): an entry per output token, the prompt's rows with the first
and the row of the token before each later one, equal to transformers' last `hidden_states`
(after the final norm) over prompt + output[:-1]; a prompt run in chunks and one the prefix
cache holds give the same rows; no compile while serving; without the flag, SGLang's refusal."""
import asyncio

import numpy as np
import pytest
import torch

from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.runtime.engine.hidden_states import NOT_ENABLED, HiddenStates
from xlaserve.runtime.engine.steps import NoHiddenStates

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
# 13 tokens: two chunks of --chunked-prefill-size 8; and a short one beside it.
PROMPTS = [[5, 17, 300, 42, 9, 77, 120, 3, 250, 11, 64, 8, 91], [400, 401, 402]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    return directory, make_tiny_checkpoint(directory, "llama")


@pytest.fixture(scope="module")
def engine(checkpoint):
    with Engine(checkpoint[0], enable_return_hidden_states=True, dtype="float32",
                skip_tokenizer_init=True, page_size=4, max_running_requests=4,
                chunked_prefill_size=8, max_prefill_tokens=12,
                precompile_token_paddings="4,16", context_length=64,
                max_total_tokens=256) as engine:
        yield engine


def transformers_rows(hf_model, prompt: list[int], output: list[int]) -> np.ndarray:
    """transformers' last hidden states (after the final norm) over prompt + output[:-1]."""
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt + output[:-1]]), output_hidden_states=True)
    return out.hidden_states[-1][0].numpy()


def flattened(entries: list) -> np.ndarray:
    """SGLang's list as rows: the prompt's [P][hidden], then one [hidden] per later token."""
    return np.concatenate([np.asarray(entries[0], np.float32)]
                          + [np.asarray(e, np.float32)[None] for e in entries[1:]])


def test_hidden_states_equal_transformers_for_the_prompt_and_each_token(engine, checkpoint):
    hf_model = checkpoint[1]
    compiled = engine.core.runner.compile_count()
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_hidden_states=True)
    for prompt, out in zip(PROMPTS, outs):
        entries = out["meta_info"]["hidden_states"]
        assert len(entries) == len(out["output_ids"]) == 6  # one per output token, as SGLang
        assert np.shape(entries[0]) == (len(prompt), 64)  # the prompt's rows, then a row each
        assert all(np.shape(e) == (64,) for e in entries[1:])
        np.testing.assert_allclose(flattened(entries),
                                   transformers_rows(hf_model, prompt, out["output_ids"]),
                                   rtol=1e-4, atol=1e-4)
    # Asked again, the prompt is in the prefix cache: its rows are computed anyway; a request
    # that does not ask has no hidden states, as in SGLang.
    again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY,
                            return_hidden_states=True)
    plain = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert "hidden_states" not in plain["meta_info"]
    assert plain["meta_info"]["cached_tokens"] > 0 and plain["output_ids"] == again["output_ids"]
    np.testing.assert_allclose(flattened(again["meta_info"]["hidden_states"]),
                               flattened(outs[0]["meta_info"]["hidden_states"]), atol=1e-5)
    assert engine.core.runner.compile_count() == compiled


def test_a_streamed_engine_request_gets_them_all_with_its_final_meta_info(engine):
    whole = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY,
                            return_hidden_states=True)

    async def stream():
        return [c async for c in await engine.async_generate(
            input_ids=PROMPTS[1], sampling_params=GREEDY, stream=True, return_hidden_states=True)]

    chunks = asyncio.run(stream())
    assert all("meta_info" not in c for c in chunks[:-1])
    np.testing.assert_allclose(flattened(chunks[-1]["meta_info"]["hidden_states"]),
                               flattened(whole["meta_info"]["hidden_states"]), atol=1e-5)


def test_a_request_over_the_bound_or_to_a_server_without_the_flag_is_refused():
    with pytest.raises(ValueError, match="--enable-return-hidden-states"):
        NoHiddenStates().rows_for(3, 4, asked=True)
    assert NoHiddenStates().rows_for(3, 4, asked=False) is None
    assert NOT_ENABLED.startswith("The server is not configured to return the hidden states")
    bounded = HiddenStates(hidden_size=64, max_values=64 * 8)
    assert bounded.rows_for(3, 6, asked=True).rows.shape == (3, 64)  # 3 + 6 - 1 rows: 8
    with pytest.raises(ValueError, match="--max-hidden-state-values"):
        bounded.rows_for(3, 7, asked=True)
