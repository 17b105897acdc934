"""An engine with the prefix cache's host tier (--enable-hierarchical-cache): a device pool far
smaller than the traffic's shared prefixes, whose evicted pages move to host memory and load back
when a prompt reaches them. Outputs equal those of an engine whose pool holds everything and of
one without the tier; the tier reports the hit (cached_tokens) that a small pool alone loses;
prompts loading from the host run beside others decoding; /flush_cache empties both tiers; and
nothing compiles while serving (the copy programs are precompiled)."""
import logging
import random

import pytest

from tests.tiny_models import make_tiny_checkpoint
from xlaserve.offline import Engine
from xlaserve.server_args import ServerArgs


GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
SMALL = dict(dtype="float32", skip_tokenizer_init=True, page_size=4, max_running_requests=2,
             chunked_prefill_size=16, max_prefill_tokens=16, context_length=64,
             precompile_token_paddings="4,16,32", log_level="warning")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    make_tiny_checkpoint(directory, "llama")
    return directory


def conversations(seed: int = 0):
    """Four conversations of 24-token system prompts, three turns each, interleaved: 96 tokens
    of prefixes against a 72-token device pool."""
    rng = random.Random(seed)
    systems = [[rng.randrange(512) for _ in range(24)] for _ in range(4)]
    return [s + [rng.randrange(512) for _ in range(6)] for _ in range(3) for s in systems]


def run(checkpoint, prompts, **options):
    with Engine(checkpoint, **SMALL, **options) as engine:
        results = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
        host = engine.core.scheduler.cache.host
        return ([r["output_ids"] for r in results],
                sum(r["meta_info"]["cached_tokens"] for r in results), host)


def test_the_host_tier_keeps_the_prefixes_a_small_pool_loses_with_equal_outputs(checkpoint,
                                                                                 caplog):
    prompts = conversations()
    everything, hits_everything, _ = run(checkpoint, prompts, max_total_tokens=1024)
    small, hits_small, _ = run(checkpoint, prompts, max_total_tokens=72)
    with caplog.at_level(logging.INFO):
        tiered, hits_tiered, host = run(checkpoint, prompts, max_total_tokens=72,
                                        enable_hierarchical_cache=True, hicache_ratio=4)
    assert tiered == small == everything
    assert hits_small == 0 < hits_tiered == hits_everything  # every later turn's system prompt
    assert host.saved_pages > 0 and host.loaded_pages >= 2 * 4 * 6  # 2 later turns x 4 x 6 pages
    assert "Hierarchical cache: a host tier of 72 pages" in caplog.text  # 4 x 18
    assert "COMPILED WHILE SERVING" not in caplog.text


def test_prompts_loading_from_the_host_run_beside_decoding_ones(checkpoint):
    prompts = conversations(seed=1)
    with Engine(checkpoint, **SMALL, max_total_tokens=72, enable_hierarchical_cache=True,
                hicache_ratio=4) as engine:
        alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
                 for p in prompts[:4]]
        # All at once: two run, two wait; each admission loads its system prompt back while
        # the other request decodes, and evicts the other conversations' pages to the host.
        together = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        host = engine.core.scheduler.cache.host
        loads = host.loaded_pages
        assert [r["output_ids"] for r in together[:4]] == alone
        assert all(r["meta_info"]["cached_tokens"] >= 20 for r in together[4:])
        assert loads > 0
        engine.core.flush_cache()
        assert engine.core.scheduler.cache.host_pages == 0
        again = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == alone[0]


@pytest.mark.parametrize("flags,message", [
    (dict(disable_radix_cache=True), "with --disable-radix-cache"),
    (dict(speculative_algorithm="NGRAM"), "with --speculative-algorithm"),
    (dict(hicache_ratio=0), "--hicache-ratio must be positive")])
def test_what_the_host_tier_does_not_run_with_stops_start_up(flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(enable_hierarchical_cache=True, **flags)
