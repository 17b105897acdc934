"""`--load-format dummy`: random weights from a config.json alone, sharded as loaded ones, and the
configs of real models shipped in benchmarks/configs."""
import logging
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.weights.loader import default_mesh, load_model
from xlaserve.model.config.encoder_config import model_config_from_hf
from xlaserve.model.registry import architecture_of, model_class
from xlaserve.model.sharding import partition_spec
from xlaserve.weights.tokenizer_files import MissingTokenizerError
from xlaserve.model.transformer import abstract_model, param_count
from xlaserve.offline import Engine

CONFIGS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
# Published sizes, in billions of parameters (the model cards' figures).
PUBLISHED_SIZES = {"smollm2-135m": 0.135, "qwen2.5-0.5b": 0.49, "qwen2.5-7b": 7.6,
                   "llama-3.1-8b": 8.0, "qwen3-8b": 8.2, "qwen3-30b-a3b": 30.5,
                   "mixtral-8x7b": 46.7, "qwen1.5-moe-a2.7b": 14.3, "gpt-oss-20b": 20.9,
                   "gpt-oss-120b": 116.8, "deepseek-v3": 671.0, "deepseek-v2-lite": 15.7,
                   "gemma-3-1b": 1.0,
                   "gemma-3-27b-text": 27.0,  # gemma-3-27b-it (27.4B) less its 0.4B vision tower
                   # the model card's rounded 31B (xlaserve's count of the text decoder: 30.81B)
                   "gemma-4-31b-text": 31.0,
                   # Scout's 109B total (its card's figure, the vision encoder included)
                   "llama-4-scout-text": 109.0,
                   # its vision encoder and projector too (xlaserve's count: 108.64B)
                   "llama-4-scout": 109.0,
                   # the image checkpoints, vision towers included (MTP layers not built)
                   "qwen3.5-397b-a17b": 397.0, "qwen3.5-35b-a3b": 35.0, "qwen3.5-27b": 27.0,
                   "nemotron-3-nano-30b-a3b": 31.6, "nemotron-h-56b-base": 56.0}
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
SMALL_ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, page_size=4,
                    max_running_requests=2, max_total_tokens=128, context_length=64,
                    disable_precompile=True)


def write_tiny_config(directory, num_layers: int = 2, **overrides) -> str:
    """A config.json (and nothing else) of a tiny Qwen2 in `directory`; returns the directory."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=num_layers, vocab_size=512,
                         **overrides)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(str(directory))
    return str(directory)


def _params(loaded) -> dict:
    return {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(loaded.model))}


def _load(path, **kwargs):
    return load_model(str(path), load_format="dummy", skip_tokenizer_init=True, progress=False,
                      **kwargs)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    return write_tiny_config(tmp_path_factory.mktemp("tiny_qwen2"))


def test_dummy_weights_have_the_models_shapes_dtype_and_partition_specs(tiny_config):
    loaded = _load(tiny_config, dtype="bfloat16")
    expected = dict(nnx.to_flat_state(nnx.state(abstract_model(loaded.config, jnp.bfloat16))))
    params = _params(loaded)
    assert params.keys() == expected.keys()
    mesh = default_mesh()
    for path, value in params.items():
        assert value.shape == expected[path].get_value().shape, path
        assert value.dtype == jnp.bfloat16, path
        assert value.sharding == NamedSharding(mesh, partition_spec(path)), path
    # Norm scales are 1; matrices and biases small and centred (std 0.02).
    assert np.all(np.asarray(params[("final_norm", "scale")], np.float32) == 1.0)
    qkv = np.asarray(params[("layers", 0, "attn", "qkv")], np.float32)
    assert abs(qkv.std() - 0.02) < 0.002 and abs(qkv.mean()) < 0.002


def test_dummy_weights_are_deterministic_for_a_seed_and_differ_across_seeds(tiny_config):
    first, again, other = (_params(_load(tiny_config, seed=s)) for s in (7, 7, 8))
    for path in first:
        np.testing.assert_array_equal(first[path], again[path], err_msg=str(path))
    for path in [("embedding",), ("layers", 1, "mlp", "down")]:
        assert np.mean(np.asarray(first[path]) == np.asarray(other[path])) < 0.01, path


def test_model_path_may_be_the_config_json_file_itself(tiny_config):
    from_file = _load(os.path.join(tiny_config, "config.json"))
    from_dir = _load(tiny_config)
    assert from_file.config == from_dir.config
    assert from_file.name == os.path.basename(tiny_config.rstrip("/"))  # the directory's name
    np.testing.assert_array_equal(_params(from_file)[("embedding",)], _params(from_dir)[("embedding",)])


def test_engine_generates_from_dummy_weights_on_the_native_gemm_and_on_xla(tiny_config):
    prompts = [[5, 17, 300, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    outputs = {}
    for backend in ("native", "xla"):
        with Engine(model_path=tiny_config, dtype="float32", matmul_backend=backend,
                    **SMALL_ENGINE) as engine:
            assert (engine.core.runner.kernels.packed_matmul is not None) == (backend == "native")
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        outputs[backend] = [r["output_ids"] for r in results]
        assert all(len(ids) == GREEDY["max_new_tokens"] for ids in outputs[backend])
        assert all(r["text"] == "" for r in results)  # no tokenizer: ids only
    assert outputs["native"] == outputs["xla"]


def test_a_deep_bfloat16_dummy_model_gives_finite_logprobs(tmp_path):
    directory = write_tiny_config(tmp_path, num_layers=28)
    with Engine(model_path=directory, dtype="bfloat16", **SMALL_ENGINE) as engine:
        result = engine.generate(input_ids=[3, 4, 5, 6, 7], sampling_params=GREEDY,
                                 return_logprob=True, logprob_start_len=0)
    logprobs = [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]
    logprobs += [lp for lp, _, _ in result["meta_info"]["input_token_logprobs"] if lp is not None]
    assert len(logprobs) == 6 + 4 and np.all(np.isfinite(logprobs)), logprobs


def test_tokenizer_files_next_to_the_config_are_loaded(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = write_tiny_config(tmp_path)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(directory)
    loaded = load_model(directory, load_format="dummy", progress=False)
    # (transformers picks the tokenizer class from config.json's model_type: its own pre-tokenizer)
    assert loaded.tokenizer.convert_tokens_to_ids(["hello", "world"]) == [1, 2]


def test_missing_tokenizer_without_skip_tokenizer_init_is_a_one_line_error(tiny_config):
    with pytest.raises(MissingTokenizerError, match="--skip-tokenizer-init") as raised:
        load_model(tiny_config, load_format="dummy", progress=False)
    assert "\n" not in str(raised.value)


def test_launch_server_reports_the_missing_tokenizer_and_exits_2(tiny_config, tmp_path, caplog):
    from xlaserve import launch_server

    with caplog.at_level(logging.ERROR, logger="xlaserve"):
        status = launch_server.main(["--model-path", tiny_config, "--load-format", "dummy",
                                     "--file-storage-path", str(tmp_path / "storage")])
    assert status == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "has no tokenizer files" in errors[0] and "--skip-tokenizer-init" in errors[0]


def test_help_offers_load_format_auto_and_dummy():
    result = subprocess.run([sys.executable, "-m", "xlaserve.launch_server", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    entry = result.stdout.split("\n  --load-format {auto,dummy}", 1)[1][:500]  # its help, not usage
    assert '"dummy" initializes them with random values' in " ".join(entry.split())


TENSOR_PARALLEL_SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from xlaserve.weights.loader import load_model
    from xlaserve.model.sharding import partition_spec
    from xlaserve.offline import Engine

    assert len(jax.devices()) == 2, jax.devices()
    single = load_model(sys.argv[1], load_format="dummy", skip_tokenizer_init=True, progress=False)
    single = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(single.model))}
    with Engine(model_path=sys.argv[1], load_format="dummy", skip_tokenizer_init=True, tp_size=2,
                page_size=4, max_running_requests=2, max_total_tokens=128, context_length=64,
                disable_precompile=True) as engine:
        loaded = engine.core.loaded
        for path, variable in nnx.to_flat_state(nnx.state(loaded.model)):
            value = variable.get_value()
            assert value.sharding == NamedSharding(loaded.mesh, partition_spec(path)), path
            # The values do not depend on the mesh: each device made its own shard of the same array.
            np.testing.assert_array_equal(np.asarray(value), single[path], err_msg=str(path))
        qkv = loaded.model.layers[0].attn.qkv.get_value()
        assert {s.data.shape for s in qkv.addressable_shards} == {(64, 1, 4, 16)}
        out = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert [len(o["output_ids"]) for o in out] == [4, 4], out
    print("ok")
""")


def test_tensor_parallel_dummy_weights_follow_their_partition_specs(tiny_config):
    result = subprocess.run(
        [sys.executable, "-c", TENSOR_PARALLEL_SCRIPT, tiny_config], capture_output=True,
        text=True, timeout=600,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
             "PATH": "/usr/bin:/bin", "TRANSFORMERS_VERBOSITY": "error"},
    )
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:] + result.stderr[-4000:]


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_benchmark_config_parses_and_has_the_published_parameter_count(name):
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(os.path.join(CONFIGS_DIR, name))
    config = model_config_from_hf(hf_config, architecture_of(hf_config))
    # Shapes only (nnx.eval_shape): an 8B model is never allocated. A vision model's tower too.
    model = abstract_model(config, jnp.bfloat16, model_class(config.architecture))
    billions = param_count(nnx.state(model)) / 1e9
    assert billions == pytest.approx(PUBLISHED_SIZES[name], rel=0.03), billions


def test_llama_3_1_config_gets_llama3_rope_scaling():
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(os.path.join(CONFIGS_DIR, "llama-3.1-8b"))
    config = ModelConfig.from_hf(hf_config, architecture_of(hf_config))
    assert (config.rope.kind, config.rope.factor, config.rope.theta) == ("llama3", 8.0, 500000.0)
    assert config.rope.original_max_position_embeddings == 8192
    assert config.eos_token_ids == (128001, 128008, 128009)
