"""A vision-language checkpoint's config (issue 55): the three families read, and what the
vision tower does not run stops the load with one line naming it."""
import json

import pytest

from tests.compile_targets import CONFIGS
from xlaserve.weights.loader import read_config


def _config(tmp_path, name: str, **vision) -> str:
    config = json.loads((CONFIGS / name / "config.json").read_text())
    config["vision_config"].update(vision)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_published_configs_read_as_their_towers(tmp_path):
    qwen25, _ = read_config(str(CONFIGS / "qwen2.5-vl-7b"), load_format="dummy")
    assert (qwen25.vision.kind, qwen25.vision.fullatt_blocks, qwen25.vision.merged_per_window,
            qwen25.rope.mrope_section, qwen25.rope.mrope_interleaved) == (
        "qwen2_5_vl", (7, 15, 23, 31), 4, (16, 24, 24), False)
    qwen3, _ = read_config(str(CONFIGS / "qwen3-vl-8b"), load_format="dummy")
    assert (qwen3.vision.kind, qwen3.vision.levels, qwen3.qk_norm, qwen3.rope.mrope_interleaved,
            qwen3.vision.num_position_embeddings) == ("qwen3_vl", 4, True, True, 2304)


@pytest.mark.parametrize("name,vision,message", [
    ("qwen2.5-vl-7b", {"hidden_act": "gelu"}, "vision hidden_act 'gelu'"),
    ("qwen2.5-vl-7b", {"window_size": 100}, "window_size 100"),
    ("qwen3-vl-8b", {"num_position_embeddings": 2000}, "num_position_embeddings 2000"),
    ("qwen3-vl-8b", {"deepstack_visual_indexes": [8, 40]}, "deepstack_visual_indexes")])
def test_what_the_tower_does_not_run_is_refused_by_name(tmp_path, name, vision, message):
    with pytest.raises(ValueError, match=message):
        read_config(_config(tmp_path, name, **vision), load_format="dummy")


def test_a_vision_model_is_not_quantized_at_load_or_served_as_embeddings(tmp_path):
    from xlaserve.weights.loader import load_model

    for options in ({"quantization": "int8"}, {"lm_head": False}):
        with pytest.raises(ValueError, match="vision-language model"):
            load_model(str(CONFIGS / "qwen2.5-vl-7b"), load_format="dummy",
                       skip_tokenizer_init=True, **options)
