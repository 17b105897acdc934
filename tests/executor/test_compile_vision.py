"""A vision-language server's programs (issue 55) compiled for one H100 and for TPU v6e (2x2,
tensor parallel over 4 chips) without the hardware (runtime/executor/aot.py): the serving step
that takes image rows (and Qwen3-VL's DeepStack rows) and the vision tower for a bucket of
patches (its attention JAX's Pallas flash attention on the GPU, splash on the TPU), at
Qwen2.5-VL-7B's, Qwen3-VL-8B's, gemma-3-4b's, Llama-4-Scout's and gemma-4-31b's widths with a few
layers and blocks, with the platform's real compilers (Mosaic's layout and memory checks). Gemma
3's and 4's steps also hold their image tokens' attention within their image (the kernels' prefix_only part over the
step's images, pallas_kernels/ragged_paged_attention/image_spans.py). Scout's encoder: 2 tiles,
segments of 577 rows (its largest bucket, 17 tiles, compiled for v6e tp 4 in 38 s with 170 MiB
of temporaries at 2 layers, measured once)."""
import json

import jax.numpy as jnp
import pytest

from tests.compile_targets import CONFIGS, devices
from xlaserve.model.sharding import serving_mesh
from xlaserve.runtime.executor.aot import server_step, vision_tower_compiled
from xlaserve.runtime.sampling.step_needs import PLAIN
from xlaserve.server_args import ServerArgs
from xlaserve.weights.loader import read_config

QWEN3_VL_8B = json.loads((CONFIGS / "qwen3-vl-8b" / "config.json").read_text())


# gemma-3-4b-it's config.json as published (its fields that set shapes), cut below: a local and
# a global text layer, 2 SigLIP layers of 896-pixel images in 14-pixel patches pooled to 256.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "mm_tokens_per_image": 256, "boi_token_index": 255999, "eoi_token_index": 256000,
    "image_token_index": 262144,
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                    "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "vocab_size": 262208},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                      "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def _gemma4_31b_images(layers: int, tower_layers: int) -> dict:
    """gemma-4-31b-it's form cut to `layers` decoder and `tower_layers` tower layers: its text
    config (benchmarks/configs/gemma-4-31b-text), its image tokens seeing their whole image in
    the sliding layers ("vision"), beside transformers' default Gemma 4 vision tower (the
    published 31B tower's own fields are not copied here)."""
    import transformers

    text = json.loads((CONFIGS / "gemma-4-31b-text" / "config.json").read_text())
    text = {k: v for k, v in text.items() if k != "architectures"}
    text.update(model_type="gemma4_text", use_bidirectional_attention="vision",
                num_hidden_layers=layers, layer_types=text["layer_types"][:layers])
    vision = transformers.Gemma4VisionConfig(num_hidden_layers=tower_layers).to_dict()
    config = transformers.Gemma4Config(text_config=text, audio_config=None,
                                       vision_config=vision).to_dict()
    config["architectures"] = ["Gemma4ForConditionalGeneration"]
    return config


def _config(model: str, directory) -> str:
    """The model's config.json (and its processor's) cut to 2 decoder layers and 2 vision
    blocks (Qwen2.5-VL: one windowed, one full; Qwen3-VL: both DeepStack layers; Gemma 3: a
    local and a global layer; Gemma 4: five sliding layers and a global one)."""
    if model == "gemma-4-31b":  # five sliding layers and a global one, 2 tower layers
        config = _gemma4_31b_images(layers=6, tower_layers=2)
    elif model == "llama-4-scout":
        config = json.loads((CONFIGS / model / "config.json").read_text())
        config["text_config"]["num_hidden_layers"] = 2
        config["vision_config"]["num_hidden_layers"] = 2
    elif model == "gemma-3-4b":
        config = json.loads(json.dumps(GEMMA3_4B))
        config["text_config"].update(num_hidden_layers=2,
                                     layer_types=["sliding_attention", "full_attention"])
        config["vision_config"]["num_hidden_layers"] = 2
    elif model == "qwen2.5-vl-7b":
        config = json.loads((CONFIGS / model / "config.json").read_text())
        config["num_hidden_layers"] = 2
        config["vision_config"].update(depth=2, fullatt_block_indexes=[1])
    else:
        config = json.loads(json.dumps(QWEN3_VL_8B))
        config["text_config"]["num_hidden_layers"] = 2
        config["vision_config"].update(depth=2, deepstack_visual_indexes=[0, 1])
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize("target,tp_size", [
    ("h100", 1),
    ("v6e:2x2", 4)])
@pytest.mark.parametrize("model", ["qwen2.5-vl-7b", "qwen3-vl-8b", "gemma-3-4b",
                                   "llama-4-scout", "gemma-4-31b"])
def test_vision_step_and_tower_compile(target, tp_size, model, tmp_path):
    """A vision model's serving step and its tower compiled for the target at the real model's
    shapes: 12-16 s on a 2-core CPU for v6e tp 4 (the tower the most), two programs through XLA's
    TPU compiler."""
    platform, target_devices = devices(target)  # skips where the compile-only package is absent
    path = _config(model, tmp_path)
    args = ServerArgs(model_path=path, tp_size=tp_size, max_running_requests=64,
                      chunked_prefill_size=2048, max_prefill_tokens=2048, context_length=32768)
    program, shapes, description = server_step(target, args)
    config, _ = read_config(path, load_format="dummy")
    assert program.input_embeds[0] == config.vision.levels == (3 if "qwen3" in model else 1)
    # The smallest bucket: a step takes its share of an image's rows, whatever its size
    # (executor/image_rows.py). Qwen3-VL's step on v6e: 17.2 s at 256 tokens, 4.6 s here.
    step = program.compile(*shapes[0], PLAIN)
    assert step.memory_analysis().argument_size_in_bytes > 0, description
    mesh = serving_mesh(target_devices, tp_size)
    patches = 2 * 576 if model == "llama-4-scout" else 1024  # Scout: 2 tiles
    tower = vision_tower_compiled(config, jnp.bfloat16, mesh, platform, patches)
    hlo = tower.as_text()  # the tower's attention: the platform's flash kernel
    assert ("tpu_custom_call" in hlo) if platform == "tpu" else ("triton" in hlo)
