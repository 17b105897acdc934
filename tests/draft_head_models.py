"""Tiny random speculative draft heads (EAGLE-3 heads, DeepSeek's multi-token-prediction layer)
for a tiny target checkpoint, and their PyTorch references: what the head should draft for a
sequence, computed from scratch (transformers' hidden states, the head's layer over the whole
sequence, no cache)."""
import json
import os

import numpy as np
import torch
from safetensors.numpy import save_file

from benchmarks.random_heads import write_random_eagle3_head


def make_eagle3_head(directory: str, target_dir: str, *, draft_vocab: int = 384,
                     capture=(0, 1, 2), seed: int = 1) -> dict:
    """A random EAGLE-3 head (benchmarks/random_heads.py) for the target in `target_dir`, with
    its own RoPE (theta 10000, not the target's) and a draft vocabulary of `draft_vocab`
    target ids; returns its tensors and config."""
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    return write_random_eagle3_head(directory, hidden=target["hidden_size"],
                                    heads=target["num_attention_heads"],
                                    vocab=target["vocab_size"], intermediate=96,
                                    draft_vocab=draft_vocab, capture=capture, seed=seed)


def _rms(x, scale, eps=1e-6):
    return scale * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta, head_dim):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions[:, None].double() * inv[None]
    cos, sin = torch.cos(angles).float()[:, None], torch.sin(angles).float()[:, None]
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _eagle3_layer(head: dict, embeds, states):
    """The head's layer over a whole sequence (causal): its output before the final norm."""
    t, c = {k: torch.from_numpy(np.asarray(v)) for k, v in head["tensors"].items()}, head["config"]
    n, heads, kv_heads = embeds.shape[0], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c["hidden_size"] // heads
    x = torch.cat([_rms(embeds, t["midlayer.input_layernorm.weight"]),
                   _rms(states, t["midlayer.hidden_norm.weight"])], -1)
    positions = torch.arange(n)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, head_dim)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv_heads, head_dim)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv_heads, head_dim)
    q, k = _rope(q, positions, c["rope_theta"], head_dim), _rope(k, positions, c["rope_theta"], head_dim)
    k = k.repeat_interleave(heads // kv_heads, 1)
    v = v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * head_dim ** -0.5
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    r = states + out @ t["midlayer.self_attn.o_proj.weight"].T
    m = _rms(r, t["midlayer.post_attention_layernorm.weight"])
    m = (torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T)
         * (m @ t["midlayer.mlp.up_proj.weight"].T)) @ t["midlayer.mlp.down_proj.weight"].T
    return r + m


def eagle3_reference_drafts(target_model, head: dict, sequence: list[int], count: int) -> list[int]:
    """The `count` tokens the head drafts after `sequence` (prompt and outputs; its last token
    not yet run by the target), chained greedily, computed from scratch."""
    t, c = head["tensors"], head["config"]
    capture = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with torch.no_grad():
        out = target_model(torch.tensor([sequence[:-1]]), output_hidden_states=True)
        # The ids name layers by their output, transformers' hidden_states[i + 1] (the input of
        # layer i + 1; the last entry, after the final norm, is never one).
        assert all(i + 1 < len(out.hidden_states) - 1 for i in capture)
        aux = torch.cat([out.hidden_states[i + 1][0] for i in capture], -1)
        states = aux @ torch.from_numpy(t["fc.weight"]).T
        embedding = target_model.get_input_embeddings().weight
        tokens = list(sequence[1:])
        lm_head = torch.from_numpy(t["lm_head.weight"])
        d2t = torch.from_numpy(t["d2t"])
        drafts = []
        for _ in range(count):
            x = _eagle3_layer(head, embedding[torch.tensor(tokens)], states)
            last = x[-1]
            draft_id = int(torch.argmax(_rms(last, torch.from_numpy(t["norm.weight"])) @ lm_head.T))
            token = draft_id + int(d2t[draft_id])
            drafts.append(token)
            tokens.append(token)
            states = torch.cat([states, last[None]], 0)
    return drafts


def eagle3_reference_beam(target_model, head: dict, sequence: list[int], topk: int,
                          steps: int) -> list[tuple[tuple[int, ...], float]]:
    """The head's beam from scratch (runtime/executor/drafts/draft_tree.py): (path of drafted tokens,
    its log-probability under the head) of every node of `steps` levels of the `topk` likeliest
    paths, each path's head rows computed over the whole sequence and the path."""
    t, c = head["tensors"], head["config"]
    capture = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    with torch.no_grad():
        out = target_model(torch.tensor([sequence[:-1]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i + 1][0] for i in capture], -1)
        target_states = aux @ torch.from_numpy(t["fc.weight"]).T
        embedding = target_model.get_input_embeddings().weight
        lm_head = torch.from_numpy(t["lm_head.weight"])
        d2t = torch.from_numpy(t["d2t"])

        def children(path):  # (token, log-probability) of the topk likeliest after `path`
            tokens, states = list(sequence[1:]), target_states
            x = None
            for depth in range(len(path) + 1):
                x = _eagle3_layer(head, embedding[torch.tensor(tokens)], states)
                if depth < len(path):
                    tokens.append(path[depth])
                    states = torch.cat([target_states, x[len(sequence) - 2:]], 0)
            logits = _rms(x[-1], torch.from_numpy(t["norm.weight"])) @ lm_head.T
            logprobs, ids = torch.topk(torch.log_softmax(logits.double(), -1), topk)
            return [(int(i) + int(d2t[int(i)]), float(p)) for i, p in zip(ids, logprobs)]

        return _beam(children, topk, steps)


def _beam(children, topk: int, steps: int) -> list[tuple[tuple[int, ...], float]]:
    """Every node of `steps` levels of the `topk` likeliest paths, `children(path)` giving the
    (token, log-probability) candidates after a path."""
    beam = [((token,), score) for token, score in children(())]
    nodes = list(beam)
    for _ in range(steps - 1):
        candidates = [(path + (token,), score + lp) for path, score in beam
                      for token, lp in children(path)]
        beam = sorted(candidates, key=lambda c: -c[1])[:topk]
        nodes += beam
    return nodes


def add_nextn_layer(directory: str, target_model, seed: int = 2) -> dict:
    """Give the tiny DeepSeek-V3 checkpoint in `directory` a multi-token-prediction layer, as
    DeepSeek's checkpoints hold it (`model.layers.<num_hidden_layers>.*`, config
    `num_nextn_predict_layers: 1`): its decoder layer a copy of the last layer's (so that the
    reference can run transformers' own layer), `enorm`, `hnorm`, `eh_proj` and `shared_head`
    random. Returns the layer's own tensors."""
    from safetensors.numpy import load_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name[len(last):]] = tensors[name]
    rng = np.random.default_rng(seed)
    own = {"enorm.weight": 1 + 0.2 * rng.standard_normal(hidden),
           "hnorm.weight": 1 + 0.2 * rng.standard_normal(hidden),
           "eh_proj.weight": 0.1 * rng.standard_normal((hidden, 2 * hidden)),
           "shared_head.norm.weight": 1 + 0.2 * rng.standard_normal(hidden),
           "shared_head.head.weight": 0.3 * rng.standard_normal((config["vocab_size"], hidden)),
           "embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    own = {k: np.asarray(v, np.float32) for k, v in own.items()}
    tensors.update({mtp + k: v for k, v in own.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 1}, f)
    return own


def nextn_reference_beam(target_model, own: dict, sequence: list[int], topk: int,
                         steps: int) -> list[tuple[tuple[int, ...], float]]:
    """`eagle3_reference_beam` of the multi-token-prediction layer (`nextn_reference_drafts`'
    rows), each path's rows computed over the whole sequence and the path."""
    t = {k: torch.from_numpy(v) for k, v in own.items()}
    inner = target_model.model
    with torch.no_grad():
        target_states = inner(torch.tensor([sequence[:-1]])).last_hidden_state[0]

        def children(path):
            tokens, states = list(sequence[1:]) + list(path), target_states
            normed = None
            for depth in range(len(path) + 1):
                n = len(sequence) - 1 + depth
                e = _rms(inner.embed_tokens.weight[torch.tensor(tokens[:n])], t["enorm.weight"])
                x = torch.cat([e, _rms(states, t["hnorm.weight"])], -1) @ t["eh_proj.weight"].T
                positions = torch.arange(n)[None]
                mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
                x = inner.layers[-1](x[None], attention_mask=mask, position_ids=positions,
                                     position_embeddings=inner.rotary_emb(x[None], positions))[0]
                normed = _rms(x, t["shared_head.norm.weight"])
                states = torch.cat([target_states, normed[len(sequence) - 2:]], 0)
            logits = normed[-1] @ t["shared_head.head.weight"].T
            logprobs, ids = torch.topk(torch.log_softmax(logits.double(), -1), topk)
            return list(zip(ids.tolist(), logprobs.tolist()))

        return _beam(children, topk, steps)


# Each multi-token-prediction layer's own tensors (`add_nextn_layer`'s, `add_qwen_mtp_layer`'s):
# the embedding's and the hidden state's norms, the projection of both, the final norm, the LM
# head (None: the model's), and what the norms' weights are added to (Qwen's 1 + weight).
DEEPSEEK_MTP = dict(enorm="enorm.weight", hnorm="hnorm.weight", proj="eh_proj.weight",
                    norm="shared_head.norm.weight", head="shared_head.head.weight", offset=0.0)
QWEN_MTP = dict(enorm="pre_fc_norm_embedding.weight", hnorm="pre_fc_norm_hidden.weight",
                proj="fc.weight", norm="norm.weight", head=None, offset=1.0)


def nextn_reference_drafts(target_model, own: dict, sequence: list[int], count: int,
                           names: dict = DEEPSEEK_MTP) -> list[int]:
    """What the multi-token-prediction layer drafts after `sequence`, from scratch: transformers'
    final (normed) hidden states, then its last decoder layer (the MTP layer's copy) over the
    whole sequence, chained greedily on its normed output (SGLang's NEXTN). `names`: which of
    `own` are its tensors (DEEPSEEK_MTP, QWEN_MTP)."""
    t = {k: torch.from_numpy(v) for k, v in own.items()}
    offset = names["offset"]
    lm_head = (t[names["head"]] if names["head"] else
               target_model.get_output_embeddings().weight)
    inner = target_model.model
    with torch.no_grad():
        states = inner(torch.tensor([sequence[:-1]])).last_hidden_state[0]
        tokens = list(sequence[1:])
        drafts = []
        for _ in range(count):
            n = len(tokens)
            e = _rms(inner.embed_tokens.weight[torch.tensor(tokens)], offset + t[names["enorm"]])
            x = torch.cat([e, _rms(states, offset + t[names["hnorm"]])], -1) @ t[names["proj"]].T
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            x = inner.layers[-1](x[None], attention_mask=mask, position_ids=positions,
                                 position_embeddings=inner.rotary_emb(x[None], positions))[0]
            normed = _rms(x[-1], offset + t[names["norm"]])
            token = int(torch.argmax(normed @ lm_head.T))
            drafts.append(token)
            tokens.append(token)
            states = torch.cat([states, normed[None]], 0)
    return drafts


def add_qwen_mtp_layer(directory: str, seed: int = 2, layers: int = 1) -> dict:
    """Give the tiny Qwen3-Next / Qwen3.5 checkpoint in `directory` its multi-token-prediction
    layer as the published ones hold it (`mtp.*`, config `mtp_num_hidden_layers: layers`): its
    decoder layer a copy of the last layer's, a full-attention one (so that the reference runs
    transformers' own layer), `fc` and the norms random. Returns the layer's own tensors."""
    from safetensors.numpy import load_file

    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    assert config["layer_types"][-1] == "full_attention"
    last, hidden = f"model.layers.{config['num_hidden_layers'] - 1}.", config["hidden_size"]
    for name in [n for n in tensors if n.startswith(last)]:
        tensors["mtp.layers.0." + name[len(last):]] = tensors[name]
    rng = np.random.default_rng(seed)
    own = {"pre_fc_norm_embedding.weight": 0.2 * rng.standard_normal(hidden),
           "pre_fc_norm_hidden.weight": 0.2 * rng.standard_normal(hidden),
           "fc.weight": 0.1 * rng.standard_normal((hidden, 2 * hidden)),
           "norm.weight": 0.2 * rng.standard_normal(hidden)}
    own = {k: np.asarray(v, np.float32) for k, v in own.items()}
    tensors.update({"mtp." + k: v for k, v in own.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config, "mtp_num_hidden_layers": layers}, f)
    return own
