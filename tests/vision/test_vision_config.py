"""A vision-language checkpoint's config (issue 55): the Qwen-VL families and Qwen3.5 (dense and
MoE) read, and what the vision tower does not run stops the load with one line naming it."""
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


def _qwen3_5_config(tmp_path, rope: dict | None = None, kind: str = "Qwen3_5", **vision) -> str:
    """transformers' default Qwen3.5 config (`kind` "Qwen3_5": head_dim 256, 32 layers;
    "Qwen3_5Moe": 40 layers, 256 experts) with a 27-block tower as wide out as the decoder,
    `rope` and `vision` fields changed."""
    import transformers

    text = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": 0.25, **(rope or {})}}
    config = getattr(transformers, kind + "Config")(text_config=text, vision_config=vision)
    config.vision_config.out_hidden_size = config.text_config.hidden_size
    config.architectures = [kind + "ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("kind,layers", [("Qwen3_5", 32), ("Qwen3_5Moe", 40)])
def test_qwen3_5_reads_as_its_hybrid_decoder_beside_a_tower_without_deepstack(tmp_path, kind,
                                                                               layers):
    """The default mrope_section [11, 11, 10] splits the 32 pairs RoPE turns (a quarter of each
    256-wide head), interleaved; the tower is Qwen3-VL's without DeepStack, even where its
    config lists DeepStack blocks (transformers' Qwen3.5 tower has no DeepStack mergers).
    Qwen3.5-MoE's decoder: experts in every layer (top 8 of 256) and no dense MLP."""
    config, _ = read_config(_qwen3_5_config(tmp_path, kind=kind, deepstack_visual_indexes=[8, 16]),
                            load_format="dummy")
    assert (config.rope.mrope_section, config.rope.mrope_interleaved,
            config.rope.partial_rotary) == ((11, 11, 10), True, 0.25)
    assert (config.vision.kind, config.vision.levels, config.vision.num_position_embeddings,
            config.vision.out_hidden_size) == ("qwen3_vl", 1, 2304, config.hidden_size)
    assert config.state_layers == tuple(i for i in range(layers) if i % 4 != 3)
    if kind == "Qwen3_5Moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_layers,
                config.shared_expert_intermediate_size, config.intermediate_size) == (
            256, 8, (True,) * 40, 512, 0)


def test_mrope_sections_must_split_the_rotated_pairs_not_the_whole_head(tmp_path):
    # 128 pairs in a head of 256, but RoPE turns 32 of them (partial_rotary_factor 0.25).
    path = _qwen3_5_config(tmp_path, {"mrope_section": [48, 40, 40], "mrope_interleaved": True})
    with pytest.raises(ValueError, match=r"mrope_section \[48, 40, 40\] must be three parts of "
                                         "the 32 rotated pairs"):
        read_config(path, load_format="dummy")
