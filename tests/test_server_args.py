"""ServerArgs is composed of one dataclass per area (xlaserve/server_args/args.py) and stays flat:
its fields are the areas' in --help's order, none declared twice (a field named again in a later
area would silently take the earlier one's place); and the table of what does not combine
(xlaserve/server_args/conflicts.py) has a row for every mode and refuses in its own words."""
import dataclasses

import pytest

from xlaserve.server_args import Mode, ServerArgs, refuse_conflicts
from xlaserve.server_args.args import AREAS
from xlaserve.server_args.conflicts import CONFLICTS


def test_the_fields_are_the_areas_in_order_each_declared_once():
    declared = [f.name for area in AREAS for f in dataclasses.fields(area)]
    assert [f.name for f in dataclasses.fields(ServerArgs)] == declared
    assert len(set(declared)) == len(declared)
    assert declared[:2] == ["model_path", "tokenizer_path"] and declared[-1] == "batch_concurrency"


def test_every_mode_has_a_row_whose_refusal_names_the_flag():
    assert set(CONFLICTS) == set(Mode)
    for message, flags in CONFLICTS.values():
        assert "{flag}" in message and flags


@pytest.mark.parametrize("mode,flags,message", [
    (Mode.VISION, dict(quantization="int8"), "--quantization with a vision-language model"),
    (Mode.EMBEDDINGS, dict(kv_cache_dtype="fp8_e5m2"), "--kv-cache-dtype fp8_e5m2 with an "),
    (Mode.MULTI_HOST, dict(dp_size=2), "--dp-size > 1 runs replicas inside one process")])
def test_a_mode_known_only_at_start_up_refuses_the_first_flag_it_does_not_run_with(
        mode, flags, message):
    args = ServerArgs(**flags)
    with pytest.raises(ValueError, match=message):
        refuse_conflicts(args, mode)
    refuse_conflicts(ServerArgs(), mode)  # nothing given: nothing refused


def test_hidden_states_refuse_speculation_multi_host_and_an_embedding_server_as_flags_are_read():
    for flags, message in [(dict(speculative_algorithm="NGRAM"), "--speculative-algorithm"),
                           (dict(nnodes=2, node_rank=0, dist_init_addr="127.0.0.1:5000"),
                            "--nnodes > 1"),
                           (dict(is_embedding=True), "--enable-return-hidden-states with an "
                                                     "embedding model")]:
        with pytest.raises(ValueError, match=message):
            ServerArgs(enable_return_hidden_states=True, **flags)
    assert ServerArgs(enable_return_hidden_states=True).max_hidden_state_values == 1 << 22
