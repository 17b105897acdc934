"""Tree drafting with a draft head (--speculative-eagle-topk K > 1, SGLang's EAGLE tree; an
EAGLE-3 head or NEXTN's MTP layer):
a beam of K paths, `steps` levels deep, from which the likeliest nodes make the tree the target
verifies (runtime/executor/verified_rows.py walks it).

Level 1 is the K likeliest drafts of the head's state the serving step left in the request's
slot (draft_head_step.catch_up_head). Each later level takes the K likeliest of the K x K
children of the last level's nodes, by their path's log-probability (the sum of their drafts'
under the head). To draft level j + 1 the head runs over every node of levels 1..j as one row
of the request (`tree_tokens.py`: each node attends to the head's cache of the sequence and to
its own ancestors), at position `next + depth`, each node reading its parent's output: the row
is recomputed whole at each level (K x j tokens of one layer), so no level's cache entries need
to live apart from the others'. The entries the row writes past the request's position are never
read: the serving step writes those positions again.

`select_tree` then keeps the `room` likeliest nodes (a child is never likelier than its parent,
so they are a tree) in an order where each parent comes first, likeliest siblings first.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xlaserve.model.transformer import AttentionMetadata
from xlaserve.runtime.executor.page_table import apply_writes, gather_rows
from xlaserve.runtime.executor.step_inputs import split_leaves
from xlaserve.runtime.executor.weight_args import leaves_from_args
from xlaserve.runtime.scheduler.speculation import DraftTree


def make_tree_chain(graphdef, state_treedef, weight_layout, kernels, mesh, kv_sharding,
                    num_layers: int, topk: int, steps: int):
    """The jitted tree drafting:

        tree_chain(weights, kv_caches, page_table, ints, floats, rooms, *, layout)
            -> ((tokens, parents) i32[S, topk * steps], scores f32[S, topk * steps]),
               kv_caches, page_table

    over a staged batch of one token per row at each request's next position (as
    draft_head.make_chain's; `rooms` is unused, for the same call). Node n = (level - 1) * topk
    + beam; `parents` are row indices of the verified row (0: the root, n + 1: node n)."""
    replicated = NamedSharding(mesh, P())

    def tree_chain(weights, kv_caches, page_table, ints, floats, rooms, layout):
        del rooms
        batch, slots, model, page_table, pages = chain_inputs(
            graphdef, state_treedef, weight_layout, weights, page_table, ints, floats, layout)
        head = model.draft_head
        head_kv, states = kv_caches[num_layers:]
        seqs = slots.shape[0]
        first = states[slots]  # [S, hidden]: the head's output at the request's last token
        ids, scores = head.top_drafts_of_carry(first, topk, kernels, model)  # level 1
        beam = jnp.arange(topk, dtype=jnp.int32)
        nodes = {"ids": [ids], "inputs": [jnp.broadcast_to(first[:, None], (seqs, topk) +
                                                          first.shape[1:])],
                 "masks": [jnp.broadcast_to(1 << beam, (seqs, topk))],
                 "parents": [jnp.zeros((seqs, topk), jnp.int32)], "scores": [scores]}
        live = batch.num_seqs[0]
        for level in range(1, steps):
            n = topk * level  # the row: every node so far
            row = {k: jnp.concatenate(v, axis=1) for k, v in nodes.items() if k != "scores"}
            depth = jnp.repeat(jnp.arange(level, dtype=jnp.int32), topk)
            positions = (batch.positions[:seqs, None] + depth[None, :]).reshape(-1)
            metadata = AttentionMetadata(
                batch.kv_lens - 1 + n, pages,
                jnp.minimum(jnp.arange(seqs + 1, dtype=jnp.int32), live) * n, batch.num_seqs,
                row["masks"].reshape(-1), n)
            x, head_kv = head(model.embedding[...], row["ids"].reshape(-1),
                              row["inputs"].reshape(seqs * n, -1), positions, head_kv, metadata,
                              kernels)
            newest = head.carry(x).reshape(seqs, n, -1)[:, n - topk:]  # the last level's
            child_ids, child_scores = head.top_drafts_of_carry(
                newest.reshape(seqs * topk, -1), topk, kernels, model)
            paths = (nodes["scores"][-1][:, :, None]
                     + child_scores.reshape(seqs, topk, topk)).reshape(seqs, topk * topk)
            scores, picked = jax.lax.top_k(paths, topk)  # [S, topk], likeliest first
            parent = picked // topk  # the parent's beam in the last level
            nodes["ids"].append(jnp.take_along_axis(child_ids.reshape(seqs, topk * topk),
                                                    picked, axis=1))
            nodes["inputs"].append(jnp.take_along_axis(newest, parent[..., None], axis=1))
            nodes["masks"].append(jnp.take_along_axis(nodes["masks"][-1], parent, axis=1)
                                  | (1 << (n + beam))[None, :])
            # The verified row's index of the parent: 1 + its node number.
            nodes["parents"].append(1 + (level - 1) * topk + parent)
            nodes["scores"].append(scores)
        kv_caches = list(kv_caches[:num_layers]) + [head_kv, states]
        stacked = jnp.stack([jnp.concatenate(nodes["ids"], axis=1),
                             jnp.concatenate(nodes["parents"], axis=1)])
        return (stacked, jnp.concatenate(nodes["scores"], axis=1)), kv_caches, page_table

    return jax.jit(tree_chain, static_argnames=("layout",), donate_argnums=(1, 2),
                   out_shardings=((replicated, replicated), kv_sharding, replicated))


def chain_inputs(graphdef, state_treedef, weight_layout, weights, page_table, ints, floats,
                 layout):
    """What a drafting program (this one, draft_head.make_chain) starts from: (the staged batch,
    its slots, the model, the page table with the batch's writes, each row's pages)."""
    batch, _, slots, _, writes, _ = split_leaves(ints, floats, layout)
    state = jax.tree.unflatten(state_treedef, leaves_from_args(weights, weight_layout))
    page_table = apply_writes(page_table, writes)
    return (batch, slots, nnx.merge(graphdef, state), page_table,
            gather_rows(page_table, slots, batch.pages))


def select_tree(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray,
                room: int) -> DraftTree:
    """The `room` likeliest nodes of one request's drafted beam (`make_tree_chain`'s row) as a
    DraftTree: by path score, ties by level (a parent before its child), each parent before its
    children and siblings likeliest first (which DraftTree.first_path takes)."""
    order = sorted(range(len(tokens)), key=lambda n: (-float(scores[n]), n))[:room]
    order = sorted(order, key=lambda n: (_level(n, parents), -float(scores[n]), n))
    row_of = {0: 0}  # the beam's verified-row index (1 + node) -> the tree's
    out_tokens, out_parents = [], []
    for n in order:
        parent = int(parents[n])
        if parent not in row_of:  # not chosen: never, as a path's score only falls
            continue
        out_tokens.append(int(tokens[n]))
        out_parents.append(row_of[parent])
        row_of[n + 1] = len(out_tokens)
    return DraftTree(out_tokens, out_parents)


def _level(node: int, parents: np.ndarray) -> int:
    level = 0
    while node >= 0:
        node, level = int(parents[node]) - 1, level + 1
    return level
