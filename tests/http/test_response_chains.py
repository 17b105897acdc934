"""A long `previous_response_id` chain (issue 48): each turn re-sends the whole conversation, so
without the prefix cache turn k prefills all k turns again (on a CPU, minutes by ~15 turns of
~500 tokens). The chain runs on the tiny model until a turn no longer fits the context: every
turn must prefill only what it added, and the turn past the context must be a clear 400."""
import re

import pytest
from openai import BadRequestError

from tests.http.conftest import SERVER_DEFAULTS, RunningServer

PAGE = SERVER_DEFAULTS["page_size"]  # the cache holds whole pages: a partial one is recomputed
CONTEXT = 1536  # ~31 tokens a turn (message, template, answer): ~48 turns fit
MAX_OUTPUT = 8
MIN_TURNS = 40


@pytest.fixture(scope="module")
def chain_server(tiny_chat_model):
    running = RunningServer(tiny_chat_model[0], served_model_name="tiny", context_length=CONTEXT)
    yield running
    running.close()


@pytest.fixture(scope="module")
def chain(chain_server):
    """Turns of one chain until the first 400 -> (each fitting turn's response, the 400)."""
    client = chain_server.openai()
    responses, previous = [], {}
    for turn in range(1, 2 * CONTEXT // 30):
        try:
            response = client.responses.create(
                model="tiny", input=f"Turn {turn}: tell me one more short fact.", temperature=0,
                max_output_tokens=MAX_OUTPUT, **previous)
        except BadRequestError as refused:
            return responses, refused
        responses.append(response)
        previous = {"previous_response_id": response.id}
    pytest.fail(f"no 400 after {len(responses)} turns of a {CONTEXT}-token context")


def test_every_turn_of_a_long_chain_prefills_only_what_it_added(chain):
    responses, _ = chain
    assert len(responses) >= MIN_TURNS
    for turn, (last, this) in enumerate(zip(responses, responses[1:]), start=2):
        usage = this.usage
        added = usage.input_tokens - last.usage.input_tokens
        uncached = usage.input_tokens - usage.input_tokens_details.cached_tokens
        # The last turn's prompt came from the cache but for its partial last page. The last
        # answer counts as added: it is re-tokenized from its text, which may differ from the
        # ids generated (and cached) for it.
        assert uncached <= added + PAGE, (turn, usage)


def test_the_turn_past_the_context_is_a_400_naming_the_context(chain):
    responses, refused = chain
    # Refused only once the conversation nearly fills the context (a couple of turns' worth).
    assert responses[-1].usage.input_tokens + MAX_OUTPUT > CONTEXT - 64
    assert refused.status_code == 400
    error = refused.body
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "input"  # OpenAI's name; the stored conversation is part of it
    assert re.search(r"context length \(1536 tokens\)", error["message"]), error
    assert "previous_response_id" in error["message"]  # its new input alone is short


def test_an_output_that_would_overrun_the_context_blames_max_output_tokens(chain_server, chain):
    responses, _ = chain
    with pytest.raises(BadRequestError) as refused:
        chain_server.openai().responses.create(
            model="tiny", input="One more.", previous_response_id=responses[0].id,
            max_output_tokens=CONTEXT)
    error = refused.value.body
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_output_tokens")
    assert "context length is 1536 tokens" in error["message"]
    assert "max_tokens" not in error["message"]  # chat's name; not a field of this API


def test_the_chain_and_the_server_still_work_after_the_refused_turn(chain_server, chain):
    responses, _ = chain
    client = chain_server.openai()
    assert client.responses.retrieve(responses[-1].id).id == responses[-1].id
    fresh = client.responses.create(model="tiny", input="Hello again.", temperature=0,
                                    max_output_tokens=MAX_OUTPUT)
    assert fresh.status in ("completed", "incomplete")
    assert fresh.usage.output_tokens >= 1
