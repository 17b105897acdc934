"""The one interface every checkpoint format's reader offers: `TensorSource`.

A tensor source answers `get(hf_name) -> np.ndarray` in the Hugging Face naming and layout
(`[out_features, in_features]` for linear weights) and lists its `names()`. Safetensors
directories and GGUF files are sources; the quantized formats (FP8, AWQ/GPTQ) wrap one and
dequantize as they read; weights.py converts any of them to our layout. On its own so that the
formats and the conversion, which use each other, share it without importing each other.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class TensorSource(Protocol):
    def names(self) -> set[str]: ...

    def get(self, name: str) -> np.ndarray: ...
