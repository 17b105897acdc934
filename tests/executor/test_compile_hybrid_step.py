"""A hybrid linear-attention model's serving step (issue 76: Qwen3-Next-80B-A3B's config from
benchmarks/configs, its first 4 layers: three Gated DeltaNet layers and a gated full-attention
one, each with 512 experts) compiled for TPU v6e (tensor parallel over 4 chips) and one H100,
without the hardware (runtime/executor/aot.py): the linear layers and their state pools split by
head as attention is, so each device holds a quarter of the weights, KV pool and state pool; no
weight or state gathered; the state pools updated in place. With its MTP layer as a NEXTN head,
the speculative step and the head's draft steps compile for H100."""
import re

import jax
import pytest
from transformers import AutoConfig

from tests.compile_targets import cache_copies, devices, first_layers, weight_bytes
from tests.kernels.test_gated_delta_rule_pallas import rule_kernel_calls
from xlaserve.runtime.executor import aot
from xlaserve.model.config import model_config_from_hf
from xlaserve.runtime.executor.state_pool import state_bytes_per_slot
from xlaserve.runtime.sampling.step_needs import PLAIN
from xlaserve.server_args import ServerArgs


@pytest.mark.parametrize("target,tp_size", [("v6e:2x2", 4), ("h100", 1)])
def test_qwen3_next_step_splits_its_linear_layers_and_states_by_head(target, tp_size, tmp_path):
    devices(target)  # skips where the compile-only package is absent
    args = ServerArgs(model_path=first_layers("qwen3-next-80b-a3b", 4, tmp_path),
                      tp_size=tp_size, max_running_requests=64, max_prefill_tokens=512)
    program, shapes, description = aot.server_step(target, args)
    tokens, seqs, pages = shapes[-1]
    compiled = program.compile(tokens, seqs, pages, PLAIN)
    caches = program.args[1]
    kv_bytes = sum(cache.size * cache.dtype.itemsize for cache in caches[:1])
    states = [leaf for state in caches[1:] for leaf in jax.tree.leaves(state)]
    state_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in states)
    assert len(caches) == 4, description  # the full layer's KV cache, then three states
    config = model_config_from_hf(AutoConfig.from_pretrained(str(tmp_path)),
                                  "Qwen3NextForCausalLM")
    c = config.linear_attention  # a slot: the conv window and the delta rule's matrices, float32
    slot_bytes = 4 * (c.conv_dim * (c.conv_width - 1)
                      + c.num_value_heads * c.key_head_dim * c.value_head_dim)
    assert state_bytes_per_slot(config) == 3 * slot_bytes
    assert state_bytes == 3 * 65 * slot_bytes  # 64 requests' slots and the null one
    per_device = (weight_bytes(program) + kv_bytes + state_bytes) / tp_size
    argument_bytes = compiled.memory_analysis().argument_size_in_bytes
    assert 0.95 * per_device < argument_bytes < 1.1 * per_device, description
    hlo = compiled.as_text()
    # No weight or state is gathered: the only all-gathers are the logits'.
    gathers = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
    assert len(gathers) <= 2 and all(g.startswith("f32[") for g in gathers), (gathers, description)
    # The Pallas gated delta rule runs each linear layer (per device under shard_map at tp 4).
    assert len(rule_kernel_calls(hlo)) == 3, description
    # Both pools (the delta rule's 34 MB a layer a device at v6e tp 4, the convolution's
    # window) are donated and written in place, never copied whole.
    for leaf in states[:2]:
        split = leaf.sharding.spec.index(("expert", "tensor"))  # its heads' axis
        local = tuple(n // tp_size if i == split else n for i, n in enumerate(leaf.shape))
        assert not cache_copies(hlo, local, leaf.dtype), description


@pytest.mark.parametrize("target,tp_size", [("v6e:2x2", 4), ("h100", 1)])
def test_a_speculative_step_rolls_its_states_back_without_copying_a_pool(target, tp_size,
                                                                         tmp_path):
    """With NGRAM's verified rows (4 tokens), the step keeps its verified rows' states and
    commits their accepted tokens (executor/verified_rows.StateRollback): in the smallest
    bucket, both pools are still written in place (the commit's window once read in another
    view relaid the v6e pool out, and H100 copied it, 6.4 MB a layer, to write in place)."""
    devices(target)
    args = ServerArgs(model_path=first_layers("qwen3-next-80b-a3b", 4, tmp_path),
                      tp_size=tp_size, max_running_requests=64, max_prefill_tokens=512,
                      speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    program, shapes, description = aot.server_step(target, args)
    hlo = program.compile(*shapes[0], PLAIN).as_text()
    assert len(rule_kernel_calls(hlo)) == 3, description
    for leaf in jax.tree.leaves(program.args[1][1]):  # the first linear layer's two pools
        split = leaf.sharding.spec.index(("expert", "tensor"))
        local = tuple(n // tp_size if i == split else n for i, n in enumerate(leaf.shape))
        assert not cache_copies(hlo, local, leaf.dtype), description


def test_qwen3_next_with_its_mtp_layer_as_a_nextn_head_compiles_for_h100(tmp_path):
    """--speculative-algorithm NEXTN on Qwen3-Next (its first 4 layers): the MTP layer (full
    gated attention, 512 experts) rides in the serving step, its cache and state after the
    linear layers' state pools, and its draft steps compile too."""
    devices("h100")
    args = ServerArgs(model_path=first_layers("qwen3-next-80b-a3b", 4, tmp_path), tp_size=1,
                      max_running_requests=64, max_prefill_tokens=512,
                      speculative_algorithm="NEXTN", speculative_num_steps=2)
    program, shapes, description = aot.server_step("h100", args)
    assert "NextNHead draft head" in description, description
    caches = program.args[1]  # the full layer's KV, three states, the head's KV and state
    assert len(caches) == 6 and caches[4].shape == caches[0].shape, description
    program.compile(*shapes[0], PLAIN)
    program.compile_chain(*shapes[0])


@pytest.mark.parametrize("target,tp_size", [("v6e:2x2", 4), ("h100", 1)])
def test_nemotron_h_step_keeps_its_mamba_pools_in_place(target, tp_size, tmp_path):
    """Nemotron-3-Nano's first 7 blocks (Mamba-2 and experts, one without an FFN, then
    attention) at ep = tp: neither Mamba-2 pool is copied. Its states are [state 128, head_dim
    64]; the Pallas rule read such a pool row-major where XLA lays it out 128-minor on TPU, so
    v6e relaid every layer's pool out (executor/kernels.tpu_mamba2_ssm); on H100 the Pallas
    scan runs."""
    devices(target)
    args = ServerArgs(model_path=first_layers("nemotron-3-nano-30b-a3b", 7, tmp_path),
                      tp_size=tp_size, ep_size=tp_size, max_running_requests=64,
                      max_prefill_tokens=512)
    program, shapes, description = aot.server_step(target, args)
    hlo = program.compile(*shapes[0], PLAIN).as_text()
    assert len(rule_kernel_calls(hlo)) == (3 if target == "h100" else 0), description
    for leaf in jax.tree.leaves(program.args[1][1]):  # the first Mamba-2 layer's two pools
        split = leaf.sharding.spec.index(("expert", "tensor"))
        local = tuple(n // tp_size if i == split else n for i, n in enumerate(leaf.shape))
        assert not cache_copies(hlo, local, leaf.dtype), description
