"""Mamba-2's selective state-space scan over ragged batches and a state pool (Nemotron-H's
linear layers, model/mamba2.py; issue 76): the jnp reference (reference.py), which every
platform runs for now."""
from xlaserve._lazy import lazy_exports

_MODULE_OF = {  # public name -> the module of this folder that defines it (or is it)
    "mamba2_ssm": "reference", "ssm_update": "reference", "by_head": "reference",
}
__all__ = list(_MODULE_OF)
__getattr__, __dir__ = lazy_exports(__name__, _MODULE_OF)  # imported on first use
