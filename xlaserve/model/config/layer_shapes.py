"""What differs between a model's layers: the mixin `PerLayer` gives ModelConfig (model_config.py)
`layer(i)`, the config layer i is built from (its KV heads, head size and MLP width where the
model's layers differ: Gemma 4's), the layers that keep a KV cache (`cache_layers`; Gemma 4's
KV-shared layers read an earlier one's) and the RoPE tables over each one's head size."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np


class PerLayer:
    """ModelConfig's per-layer questions, answered from its fields (layer_heads,
    layer_intermediate, kv_source_layers, sliding_windows, rope, local_rope)."""

    def layer(self, index: int) -> "PerLayer":
        """The config layer `index` is built from: this one, with that layer's KV heads, head
        size and MLP width where `layer_heads` and `layer_intermediate` give them others."""
        heads = self.layer_heads[index] if self.layer_heads else (self.num_kv_heads, self.head_dim)
        inter = (self.layer_intermediate[index] if self.layer_intermediate
                 else self.intermediate_size)
        if heads == (self.num_kv_heads, self.head_dim) and inter == self.intermediate_size:
            return self
        return _one_layer(self, *heads, inter)

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache of their own, in order: the KV pool's arrays."""
        return tuple(i for i, source in enumerate(self.kv_source_layers)
                     if source == i and not self.linear_layers[i])

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The linear-attention layers (linear_attention_config.py), in order: each keeps a
        per-request state (model/linear_attention.LinearState), after the KV pool's arrays in
        the list a step carries."""
        return tuple(i for i, linear in enumerate(self.linear_layers) if linear)

    def cache_slot(self, index: int) -> int:
        """Which entry of the step's caches layer `index` reads and writes: one of the KV pool's
        arrays (`cache_layers`), or a linear layer's state after them (`state_layers`)."""
        if self.linear_layers[index]:
            return len(self.cache_layers) + self.state_layers.index(index)
        return self.cache_layers.index(self.kv_source_layers[index])

    @property
    def widest_head_dim(self) -> int:
        """The largest head size of any layer (what the kernels' shape checks are asked about)."""
        return max([self.head_dim] + [d for _, d in self.layer_heads])

    def rope_inv_freq(self) -> np.ndarray:
        """The per-pair frequencies of every RoPE table the layers read, side by side (a step's
        cos and sin rows hold them all): `rope`'s, then `local_rope`'s where there is one, each
        over the head size of the layers that read it (Gemma 4's differ)."""
        return np.concatenate(self._rope_tables())

    def rope_widths(self) -> tuple[int, ...]:
        """The pairs of each table in `rope_inv_freq`, in order (`model/rope.rope_tables`)."""
        return tuple(len(table) for table in self._rope_tables())

    def _rope_tables(self) -> list[np.ndarray]:
        tables = [self.rope] if self.local_rope is None else [self.rope, self.local_rope]
        readers = [next((i for i in range(self.num_layers) if self.rope_table(i) == t), 0)
                   for t in range(len(tables))]
        return [rope.inv_freq(self.layer(i).head_dim) for rope, i in zip(tables, readers)]

    def rope_table(self, layer: int) -> int:
        """Which of `rope_inv_freq`'s tables layer `layer` reads: 1 for a sliding-window layer
        with a RoPE of its own (Gemma 3's local layers), else 0."""
        return int(self.local_rope is not None and self.sliding_windows[layer] is not None)

    def _check_layers(self) -> None:
        """Fills the per-layer fields left empty and checks those given (__post_init__)."""
        if self.layer_heads:
            self._check_layer_heads()
        if len(self.kv_source_layers) != self.num_layers:
            object.__setattr__(self, "kv_source_layers", tuple(range(self.num_layers)))
        if any(not 0 <= s <= i or self.kv_source_layers[s] != s
               for i, s in enumerate(self.kv_source_layers)):
            raise ValueError(f"kv_source_layers {self.kv_source_layers}: a layer reads its own "
                             "cache or an earlier layer's that has one")
        if self.layer_intermediate and len(self.layer_intermediate) != self.num_layers:
            raise ValueError(f"layer_intermediate has {len(self.layer_intermediate)} entries for "
                             f"{self.num_layers} layers")

    def _check_layer_heads(self) -> None:
        if len(self.layer_heads) != self.num_layers:
            raise ValueError(f"layer_heads has {len(self.layer_heads)} entries for "
                             f"{self.num_layers} layers")
        for i, (kv_heads, head_dim) in enumerate(self.layer_heads):
            if self.num_heads % kv_heads:
                raise ValueError(f"layer {i}: num_attention_heads ({self.num_heads}) must be a "
                                 f"multiple of its {kv_heads} KV heads")
        by_table: dict[int, set[int]] = {}
        for i, (_, head_dim) in enumerate(self.layer_heads):
            by_table.setdefault(self.rope_table(i), set()).add(head_dim)
        if any(len(dims) > 1 for dims in by_table.values()):
            raise ValueError("layers of one RoPE table with different head sizes are not "
                             "supported")


def replicate_kv_heads(config, tp_size: int):
    """`config` (a ModelConfig) for attention split over `tp_size` devices by KV head: a layer
    with fewer KV heads than devices holds `tp_size / kv` copies of each (vLLM's and SGLang's
    answer; each device its query heads' KV head, its cache that many times larger), the
    checkpoint's heads repeated at load (weights/param_layout.py, `kv_replicas`). The same config
    where every layer's heads split already; ValueError where neither divides the other or the
    copies would split a KV head's group of query heads. Latent attention is left as it is (its
    cache is whole on every device)."""
    if config.mla is not None or config.bidirectional:
        return config
    heads, replicas = [], []
    for i in range(config.num_layers):
        kv_heads, head_dim = config.layer(i).num_kv_heads, config.layer(i).head_dim
        copies = 1
        if kv_heads % tp_size:
            copies = tp_size // kv_heads
            if tp_size % kv_heads or (config.num_heads // kv_heads) % copies:
                raise ValueError(
                    f"--tp-size {tp_size} does not split layer {i}'s {kv_heads} KV heads: "
                    f"attention is split by KV head, and {kv_heads} heads neither divide over "
                    f"{tp_size} devices nor copy onto them whole (each head's "
                    f"{config.num_heads // kv_heads} query heads over {tp_size // kv_heads or 1})")
        heads.append((kv_heads * copies, head_dim))
        replicas.append(copies)
    if all(r == 1 for r in replicas):
        return config
    uniform = len(set(heads)) == 1
    return dataclasses.replace(
        config, num_kv_heads=heads[0][0] if uniform else config.num_kv_heads,
        layer_heads=() if uniform else tuple(heads), kv_replicas=tuple(replicas))


@functools.lru_cache(maxsize=None)
def _one_layer(config, num_kv_heads: int, head_dim: int,
               intermediate_size: int) -> PerLayer:
    """`config` as one layer of `num_kv_heads` heads of `head_dim` and an MLP of
    `intermediate_size` (ModelConfig.layer): the same object for every layer of that shape, as a
    step's trace asks it once per layer."""
    return dataclasses.replace(config, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               intermediate_size=intermediate_size, layer_heads=(),
                               layer_intermediate=())
