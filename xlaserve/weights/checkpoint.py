"""Converted weights saved with Orbax, so a model converted once (a dequantized GGUF, say) loads
again without conversion, and restores straight into any mesh's sharded layout.

Layout of a checkpoint directory: `xlaserve_model.json` (our ModelConfig and the dtype), `params/`
(an Orbax checkpoint of the parameter tree), and the tokenizer files.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.registry import model_class
from xlaserve.model.transformer import abstract_parameters

MARKER = "xlaserve_model.json"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def save(path: str, config: ModelConfig, model, tokenizer=None) -> None:
    import orbax.checkpoint as ocp

    if any(copies > 1 for copies in config.kv_replicas):
        raise ValueError("a checkpoint holds the model's own KV heads; this one was loaded with "
                         "them copied over more devices than it has (--tp-size): save it from a "
                         "mesh whose size divides them")
    _, state = nnx.split(model)
    # Kept GGUF blocks, int8 weights, packed panels: a checkpoint holds the float model.
    quantized = [(where, type(variable.get_value()).__name__)
                 for where, variable in nnx.to_flat_state(state)
                 if not isinstance(variable.get_value(), jax.Array)]
    if quantized:
        (where, kind), = quantized[:1]
        raise ValueError(f"a checkpoint holds float weights; {'.'.join(map(str, where))} is a "
                         f"{kind}: save a model loaded with matmul_backend='xla' and no "
                         "quantization, before a ModelRunner packs it")
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(path, "params"), nnx.to_pure_dict(state), force=True)
    checkpointer.wait_until_finished()
    dtype = jax.tree.leaves(state)[0].dtype
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({"config": config.to_dict(), "dtype": jnp.dtype(dtype).name}, f, indent=1)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_config(path: str) -> ModelConfig:
    with open(os.path.join(path, MARKER)) as f:
        return ModelConfig.from_dict(json.load(f)["config"])


def load(path: str, *, dtype, mesh: Mesh):
    """The model, restored into `mesh` with each parameter's partition spec, cast to `dtype`."""
    import orbax.checkpoint as ocp

    config = load_config(path)
    graphdef, abstract_state, parameters = abstract_parameters(
        config, dtype, mesh, model_class(config.architecture))
    target = nnx.from_flat_state(parameters)
    restored = ocp.StandardCheckpointer().restore(
        os.path.join(os.path.abspath(path), "params"), nnx.to_pure_dict(target)
    )
    nnx.replace_by_pure_dict(abstract_state, restored)
    return nnx.merge(graphdef, abstract_state)
