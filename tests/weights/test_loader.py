"""Loading Hugging Face checkpoints: sharded files, dtypes, tied embeddings, errors, hub, Orbax."""
import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from xlaserve.weights import checkpoint
from xlaserve.weights.loader import ModelNotFoundError, load_model
from xlaserve.model.registry import UnsupportedArchitectureError
from xlaserve.weights.param_layout import WeightError

from tests.tiny_models import make_tiny_checkpoint


def _params(loaded):
    from flax import nnx

    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.split(loaded.model)[1])}


def _load(path, **kwargs):
    kwargs.setdefault("dtype", "float32")
    return load_model(str(path), skip_tokenizer_init=True, progress=False, **kwargs)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    make_tiny_checkpoint(str(directory), "qwen2")
    return directory


def test_sharded_safetensors_checkpoint_loads_the_same_weights(tmp_path, qwen2_dir):
    make_tiny_checkpoint(str(tmp_path), "qwen2", max_shard_size="60KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) > 2
    single, sharded = _params(_load(qwen2_dir)), _params(_load(tmp_path))
    assert single.keys() == sharded.keys()
    for path in single:
        np.testing.assert_array_equal(single[path], sharded[path], err_msg=str(path))


def test_bfloat16_checkpoint_is_cast_to_the_requested_dtype(tmp_path, qwen2_dir):
    make_tiny_checkpoint(str(tmp_path), "qwen2", dtype="bfloat16")
    as_f32 = _load(tmp_path, dtype="float32")
    assert all(a.dtype == np.float32 for a in _params(as_f32).values())
    as_bf16 = _load(qwen2_dir, dtype="bfloat16")
    params = _params(as_bf16)
    assert all(a.dtype == jnp.bfloat16 for a in params.values())
    reference = _params(_load(qwen2_dir))
    np.testing.assert_array_equal(params[("embedding",)], reference[("embedding",)].astype(jnp.bfloat16))


def test_tied_embeddings_have_no_lm_head(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama_tied_linear"]
    loaded = _load(directory)
    assert loaded.config.tie_word_embeddings
    assert not any("lm_head" in str(p) for p in _params(loaded))
    untied = _load(tiny_checkpoints["llama"][0])
    assert ("lm_head",) in _params(untied)


def test_missing_tensor_error_names_the_tensor_and_shape(tmp_path, qwen2_dir):
    shutil.copytree(qwen2_dir, tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' \(expected shape \[128, 64\]\)"):
        _load(tmp_path)


def test_mismatched_tensor_error_names_the_tensor_and_both_shapes(tmp_path, qwen2_dir):
    shutil.copytree(qwen2_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[128, 64\], expected \[96, 64\]"):
        _load(tmp_path)


def test_unknown_architecture_error_lists_the_supported_ones(tmp_path, qwen2_dir):
    shutil.copytree(qwen2_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError) as err:
        _load(tmp_path)
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_nonexistent_local_path_is_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        _load("./no/such/model")


def _run_isolated(code: str, env: dict) -> subprocess.CompletedProcess:
    """HF_HOME and HF_HUB_OFFLINE are read when huggingface_hub is imported: use a fresh process."""
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def test_hub_id_without_network_or_cache_is_a_one_line_error(tmp_path):
    result = _run_isolated(
        "from xlaserve.weights.loader import load_model\n"
        "try:\n    load_model('Qwen/Qwen2.5-0.5B-Instruct', skip_tokenizer_init=True)\n"
        "except Exception as e:\n    print(type(e).__name__ + ': ' + str(e))\n",
        {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"},
    )
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout + result.stderr
    assert lines[0].startswith("ModelNotFoundError: cannot get 'Qwen/Qwen2.5-0.5B-Instruct'")
    assert str(tmp_path / "hf") in lines[0]


def test_hub_id_loads_from_the_local_cache_in_offline_mode(tmp_path, qwen2_dir):
    # The layout huggingface_hub keeps under $HF_HOME/hub for a downloaded snapshot.
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-qwen2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(qwen2_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    result = _run_isolated(
        "from xlaserve.weights.loader import load_model\n"
        "m = load_model('tiny-org/tiny-qwen2', skip_tokenizer_init=True, progress=False)\n"
        "print(m.config.architecture, m.source)\n",
        {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "Qwen2ForCausalLM"
    assert commit in result.stdout


def test_orbax_checkpoint_round_trip_keeps_config_and_weights(tmp_path, qwen2_dir):
    loaded = _load(qwen2_dir)
    checkpoint.save(str(tmp_path / "converted"), loaded.config, loaded.model)
    restored = _load(tmp_path / "converted")
    assert restored.config == loaded.config
    before, after = _params(loaded), _params(restored)
    assert before.keys() == after.keys()
    for path in before:
        np.testing.assert_array_equal(before[path], after[path], err_msg=str(path))
    as_bf16 = _params(_load(tmp_path / "converted", dtype="bfloat16"))
    assert all(a.dtype == jnp.bfloat16 for a in as_bf16.values())


def test_orbax_checkpoint_round_trip_of_a_mixture_of_experts(tmp_path, tiny_checkpoints):
    """The experts' stacked weights, the router, the shared expert and its gate, and the config's
    per-layer MoE flags survive a save and restore (Qwen2-MoE: its second layer is dense)."""
    loaded = _load(tiny_checkpoints["qwen2_moe"][0])
    assert loaded.config.moe_layers == (True, False) and loaded.config.num_experts == 4
    checkpoint.save(str(tmp_path / "converted"), loaded.config, loaded.model)
    restored = _load(tmp_path / "converted")
    assert restored.config == loaded.config
    before, after = _params(loaded), _params(restored)
    assert ("layers", 0, "mlp", "shared_expert_gate") in before and before.keys() == after.keys()
    for path in before:
        np.testing.assert_array_equal(before[path], after[path], err_msg=str(path))


def test_a_missing_expert_tensor_is_named(tmp_path, tiny_checkpoints):
    shutil.copytree(tiny_checkpoints["mixtral"][0], tmp_path, dirs_exist_ok=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightError, match=r"missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight'"):
        _load(tmp_path)


def test_every_process_of_a_server_loads_with_the_same_options_from_its_flags():
    """Engine start-up and a multi-host follower both load through server_load_options: every
    option of load_model but a process's own (its mesh, its tokenizer, a progress bar) comes from
    the flags there, so a new option cannot reach one process and not the other."""
    import inspect

    from xlaserve.server_args import ServerArgs
    from xlaserve.weights.loader import server_load_options

    own = {"mesh", "tokenizer_path", "skip_tokenizer_init", "progress"}
    options = server_load_options(ServerArgs(model_path="m", random_seed=7, quantization="int8"))
    assert set(options) == set(inspect.signature(load_model).parameters) - own
    assert (options["model_path"], options["seed"], options["quantization"]) == ("m", 7, "int8")


def test_a_backbone_saved_without_the_model_prefix_loads_as_its_causal_lm(tmp_path):
    """Qwen3-Embedding ships its decoder's tensors as `embed_tokens.weight`, `layers.0...`,
    `norm.weight` (saved from Qwen3Model) under a Qwen3ForCausalLM config with tied embeddings:
    the same weights load as from the prefixed checkpoint."""
    full, backbone = tmp_path / "full", tmp_path / "backbone"
    make_tiny_checkpoint(str(full), "qwen3", tie_word_embeddings=True)
    shutil.copytree(full, backbone)
    [weights_file] = backbone.glob("*.safetensors")
    tensors = load_file(str(weights_file))
    assert "lm_head.weight" not in tensors and "model.norm.weight" in tensors
    save_file({name.removeprefix("model."): t for name, t in tensors.items()}, str(weights_file))
    expected, loaded = _params(_load(full)), _params(_load(backbone))
    assert expected.keys() == loaded.keys()
    for path, value in expected.items():
        np.testing.assert_array_equal(loaded[path], value, err_msg=str(path))
