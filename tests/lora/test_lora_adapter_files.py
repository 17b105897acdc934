"""What a PEFT adapter may be (weights/lora_adapter.py) and what stops its load in one line
naming it; the LoRA flags' forms (lora_flags.py); the slots' refusals (rank, targets) and the
models LoRA cannot target (model/lora.check_model)."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from xlaserve.server_args import ServerArgs, lora_paths_of, target_modules_of
from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.config.rope_config import RopeConfig
from xlaserve.model.lora import LoraSpec, check_model
from xlaserve.weights.lora_adapter import LoraAdapterError, load_adapter


CONFIG = ModelConfig(architecture="LlamaForCausalLM", rope=RopeConfig(), vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6,
                     max_position_embeddings=64, tie_word_embeddings=False)
PREFIX = "base_model.model.model.layers"


def adapter_dir(tmp_path, config=None, tensors=None, name="adapter"):
    directory = tmp_path / name
    directory.mkdir()
    rng = np.random.default_rng(0)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4,
              "target_modules": ["q_proj", "down_proj"], **(config or {})}
    if tensors is None:
        tensors = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": rng.normal(size=(2, 16)),
                   f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": rng.normal(size=(16, 2)),
                   f"{PREFIX}.1.mlp.down_proj.lora_A.weight": rng.normal(size=(2, 32)),
                   f"{PREFIX}.1.mlp.down_proj.lora_B.weight": rng.normal(size=(16, 2))}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()},
              str(directory / "adapter_model.safetensors"))
    return str(directory)


def test_an_adapter_reads_into_our_layout_scaled(tmp_path):
    adapter = load_adapter("x", adapter_dir(tmp_path), CONFIG)
    assert adapter.rank == 2 and adapter.target_modules == ("q_proj", "down_proj")
    a, b = adapter.weights[(0, "q_proj")]
    assert a.shape == (16, 2) and b.shape == (2, 2, 2, 4)  # [r, kv heads, group, head_dim]
    rs = load_adapter("y", adapter_dir(tmp_path, {"use_rslora": True}, name="rs"), CONFIG)
    np.testing.assert_allclose(rs.weights[(0, "q_proj")][1] * np.sqrt(2) / 4, b / 2, rtol=1e-6)


@pytest.mark.parametrize("config, what", [
    ({"use_dora": True}, "DoRA"), ({"peft_type": "PREFIX_TUNING"}, "peft_type PREFIX_TUNING"),
    ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"bias": "all"}, "bias 'all'"),
    ({"r": 0}, "r must be a positive integer")])
def test_what_peft_can_express_and_this_server_cannot_stops_the_load(tmp_path, config, what):
    with pytest.raises(LoraAdapterError, match=what):
        load_adapter("x", adapter_dir(tmp_path, config), CONFIG)


@pytest.mark.parametrize("key, shape, what", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", (2, 64), "embed_tokens"),
    ("base_model.model.lm_head.lora_A.weight", (2, 16), "lm_head"),
    (f"{PREFIX}.0.mlp.experts.0.gate_proj.lora_A.weight", (2, 16), "experts"),
    (f"{PREFIX}.5.self_attn.q_proj.lora_A.weight", (2, 16), "layer 5"),
])
def test_a_tensor_of_an_unsupported_target_stops_the_load(tmp_path, key, shape, what):
    tensors = {key: np.zeros(shape), key.replace("lora_A", "lora_B"): np.zeros(shape[::-1])}
    with pytest.raises(LoraAdapterError, match=what):
        load_adapter("x", adapter_dir(tmp_path, tensors=tensors), CONFIG)


def test_shapes_the_model_does_not_have_and_half_pairs_stop_the_load(tmp_path):
    tensors = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 8)),
               f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": np.zeros((16, 2))}
    with pytest.raises(LoraAdapterError, match=r"needs \[r, 16\]"):
        load_adapter("x", adapter_dir(tmp_path, tensors=tensors), CONFIG)
    half = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 16))}
    with pytest.raises(LoraAdapterError, match="without its pair"):
        load_adapter("x", adapter_dir(tmp_path, tensors=half, name="half"), CONFIG)


def test_a_pickle_or_a_missing_path_is_refused_naming_it(tmp_path):
    directory = adapter_dir(tmp_path)
    os.rename(os.path.join(directory, "adapter_model.safetensors"),
              os.path.join(directory, "adapter_model.bin"))
    with pytest.raises(LoraAdapterError, match="adapter_model.bin"):
        load_adapter("x", directory, CONFIG)
    with pytest.raises(LoraAdapterError, match="does not exist"):
        load_adapter("x", str(tmp_path / "nowhere"), CONFIG)
    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        load_adapter("x", str(tmp_path), CONFIG)


def test_models_lora_cannot_target_stop_start_up():
    import dataclasses

    moe = dataclasses.replace(CONFIG, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=8, moe_layers=(True, True))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_model(moe, LoraSpec(2, 8, ("q_proj", "gate_proj")))
    check_model(moe, LoraSpec(2, 8, ("q_proj", "o_proj")))  # attention only: served


def test_lora_flags_take_sglang_and_vllm_forms():
    assert lora_paths_of(["a=/x/a", "/y/b", '{"lora_name": "c", "lora_path": "/z"}',
                          '{"name": "d", "path": "hub/d"}']) == {
        "a": "/x/a", "b": "/y/b", "c": "/z", "d": "hub/d"}
    assert lora_paths_of(["org/adapter"]) == {"org/adapter": "org/adapter"}  # a hub id
    with pytest.raises(ValueError, match="given twice"):
        lora_paths_of(["a=/x", "a=/y"])
    assert target_modules_of(["all"])[-1] == "down_proj"
    assert target_modules_of(["q_proj,v_proj"]) == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="lm_head"):
        target_modules_of(["lm_head"])
    args = ServerArgs(lora_paths=["a=/x"])
    assert args.enable_lora and args.max_loras_per_batch == 8
    with pytest.raises(ValueError, match="speculative"):
        ServerArgs(lora_paths=["a=/x"], speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="names 2 adapters; --max-loaded-loras 1"):
        ServerArgs(lora_paths=["a=/x", "b=/y"], max_loras_per_batch=1)
    # more adapters than slots (issue 73): up to --max-loaded-loras, at least the slots
    args = ServerArgs(lora_paths=["a=/x", "b=/y"], max_loras_per_batch=1, max_loaded_loras=2)
    assert args.max_loaded_loras == 2
    assert ServerArgs(enable_lora=True, max_loras_per_batch=3).max_loaded_loras == 3
    with pytest.raises(ValueError, match="--max-loaded-loras 2 is under --max-loras-per-batch 4"):
        ServerArgs(enable_lora=True, max_loras_per_batch=4, max_loaded_loras=2)


def test_served_arguments_name_adapters_without_their_paths_on_this_disk():
    args = ServerArgs(lora_paths=["a=/x/y/sql", "/z/poem", "org/hub-adapter"])
    assert args.served().lora_paths == ["a=sql", "poem=poem", "org/hub-adapter=org/hub-adapter"]
    assert ServerArgs().served().lora_paths is None


def test_vllm_flag_names_reach_the_same_fields():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(
        ["--lora-modules", "a=/x", "b=/y", "--max-loras", "3", "--max-lora-rank", "32",
         "--enable-lora", "--max-cpu-loras", "5"]))
    assert args.lora_paths == ["a=/x", "b=/y"] and args.max_loras_per_batch == 3
    assert args.max_loaded_loras == 5
    assert args.max_lora_rank == 32 and args.enable_lora


@pytest.mark.parametrize("keep", [1 / 3, 0.0])
def test_a_truncated_weights_file_is_refused_naming_it(tmp_path, keep):
    """A cut or empty adapter_model.safetensors is the client's error (a 400 on
    /load_lora_adapter), not a SafetensorError's 500 (issue 73's finding)."""
    directory = adapter_dir(tmp_path)
    path = os.path.join(directory, "adapter_model.safetensors")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * keep)])
    with pytest.raises(LoraAdapterError, match="adapter_model.safetensors: not a readable"):
        load_adapter("x", directory, CONFIG)


def test_an_adapter_kept_in_host_memory_takes_the_slots_dtype_and_writes_the_same(tmp_path):
    """Adapters loaded beyond the slots wait in host memory (issue 73), each in the slots' dtype:
    half of float32's bytes in bfloat16, and bit for bit the slot values of the float32 one."""
    import jax

    from xlaserve.model.sharding import serving_mesh
    from xlaserve.runtime.executor.lora_slots import LoraSlots
    from xlaserve.server_args import TARGET_MODULES

    adapter = load_adapter("x", adapter_dir(tmp_path), CONFIG)
    slots = LoraSlots(LoraSpec(2, 4, TARGET_MODULES), CONFIG, "bfloat16",
                      serving_mesh(jax.devices()[:1], 1), 4, 0)
    kept = slots.host_copy(adapter)
    assert kept.nbytes * 2 == adapter.nbytes
    for ours, theirs in zip(slots._slot_values(kept), slots._slot_values(adapter), strict=True):
        assert ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes()
