"""--revision and --trust-remote-code reach the hub download and transformers' loaders."""
import json

import pytest

from tests.weights.test_dummy_load import write_tiny_config
from xlaserve.weights import loader


def test_a_hub_model_is_fetched_at_its_revision_with_its_code_only_when_trusted(monkeypatch):
    calls = []

    def snapshot_download(repo_id, allow_patterns, revision=None):
        calls.append((repo_id, allow_patterns, revision))
        return "/nowhere"

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loader.resolve_model_path("org/model", revision="v1.2")
    loader.resolve_model_path("org/model", with_weights=False, trust_remote_code=True)
    (_, first, revision), (_, second, default) = calls
    assert revision == "v1.2" and default is None
    assert "*.safetensors" in first and "*.py" not in first
    assert "*.safetensors" not in second and "*.py" in second


def test_a_config_class_shipped_with_the_checkpoint_loads_only_when_trusted(tmp_path):
    # A checkpoint whose config.json names its own config class (auto_map), as remote-code
    # models do; the architecture is one xlaserve implements.
    directory = write_tiny_config(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config.update(model_type="shipped_qwen2",
                  auto_map={"AutoConfig": "configuration_shipped.ShippedConfig"})
    path.write_text(json.dumps(config))
    (tmp_path / "configuration_shipped.py").write_text(
        "from transformers import Qwen2Config\n\n\n"
        "class ShippedConfig(Qwen2Config):\n    model_type = 'shipped_qwen2'\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        loader.read_config(directory, load_format="dummy")
    model_config, _ = loader.read_config(directory, load_format="dummy", trust_remote_code=True)
    assert model_config.architecture == "Qwen2ForCausalLM" and model_config.num_layers == 2
