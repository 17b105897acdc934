"""An FP8 KV cache's per-layer scales read from a checkpoint (xlaserve/weights/kv_scales.py):
each quantizer's names, and a refusal naming the tensor for anything that is not one positive
float per layer and tensor."""
import numpy as np
import pytest

from tests.weights.dict_source import DictSource
from xlaserve.weights.kv_scales import kv_scales
from xlaserve.weights.param_layout import WeightError


def layers(k_name, v_name, k=0.25, v=1.5, num_layers=2, shape=()):
    tensors = {f"model.layers.{i}.self_attn.q_proj.weight": np.zeros((4, 4), np.float32)
               for i in range(num_layers)}
    for i in range(num_layers):
        tensors[f"model.layers.{i}.{k_name}"] = np.full(shape, k, np.float32)
        tensors[f"model.layers.{i}.{v_name}"] = np.full(shape, v, np.float32)
    return tensors


@pytest.mark.parametrize("k_name,v_name", [
    ("self_attn.k_scale", "self_attn.v_scale"),  # compressed-tensors
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),  # ModelOpt
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")],  # Quark
    ids=["compressed_tensors", "modelopt", "quark"])
def test_each_quantizers_names_give_every_layers_k_and_v_scale(k_name, v_name):
    assert kv_scales(DictSource(layers(k_name, v_name, shape=(1,))), 2) == ((0.25, 1.5),) * 2


def test_autofp8s_one_kv_scale_is_both_and_a_checkpoint_without_scales_gives_none():
    tensors = {f"model.layers.{i}.self_attn.kv_scale": np.float32(0.5) for i in range(3)}
    assert kv_scales(DictSource(tensors), 3) == ((0.5, 0.5),) * 3
    assert kv_scales(DictSource({"model.layers.0.self_attn.q_proj.weight": np.zeros(2)}), 1) is None


@pytest.mark.parametrize("tensors,message", [
    (layers("self_attn.k_scale", "self_attn.v_scale", shape=(2,)),
     "model.layers.0.self_attn.k_scale: a KV cache scale is one float per tensor; got float32[2] "
     "(per-head or per-channel KV scales are not supported)"),
    (layers("self_attn.k_scale", "self_attn.v_scale", k=-1.0),
     "model.layers.0.self_attn.k_scale: a KV cache scale must be positive and finite; got -1.0"),
    (layers("self_attn.k_scale", "self_attn.v_scale", v=np.inf),
     "model.layers.0.self_attn.v_scale: a KV cache scale must be positive and finite; got inf"),
    ({k: v for k, v in layers("self_attn.k_scale", "self_attn.v_scale").items()
      if k != "model.layers.1.self_attn.v_scale"},
     "the checkpoint gives KV cache scales, but not layer 1's v_scale "
     "(model.layers.1.self_attn.v_scale)")],
    ids=["per_head", "negative", "infinite", "a_layer_missing"])
def test_scales_that_cannot_be_used_stop_the_load_naming_the_tensor(tensors, message):
    with pytest.raises(WeightError) as refusal:
        kv_scales(DictSource(tensors), 2)
    assert str(refusal.value) == message
