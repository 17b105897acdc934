"""Speculative decoding's draft heads: one decoder layer that drafts a request's next tokens
from the target model's hidden states (runtime/executor/drafts/draft_head.py runs them).

- `Eagle3Head` (`--speculative-algorithm EAGLE3`, SGLang's `LlamaForCausalLMEagle3` checkpoints,
  such as those published for Llama-3.1-8B-Instruct): the target's residual stream entering three
  of its layers (`capture_layers`, by default 2, L/2 and L-3, or the layers after the
  checkpoint's `eagle_aux_hidden_state_layer_ids`), concatenated and projected by `fc`, beside the next
  token's embedding (the target's); q, k and v read both side by side (2 x hidden wide). Its LM
  head covers a smaller draft vocabulary, mapped to the target's ids by `draft_to_target`
  (the checkpoint's `d2t` offsets).
- `NextNHead` (`--speculative-algorithm NEXTN`): a checkpoint's own multi-token-prediction layer:
  a projection of the next token's normed embedding beside the target's normed final hidden
  state, one decoder layer of the target's config, a final norm and an LM head. DeepSeek-V3/R1's
  is `model.layers.<num_hidden_layers>` (`eh_proj`, latent attention and experts, its own
  `shared_head` norm and LM head); Qwen3-Next's and Qwen3.5's is `mtp.*` (`fc`, a full gated
  attention layer with the target's MLP or experts, `norm`: (1 + weight) norms, as the target's),
  drafting through the target's own LM head (`shared_lm_head`: none of its own).

Both run on a packed ragged batch as the target does, and keep a paged KV cache of one layer
with the target's pages (the same page ids). The head at position t reads the token at t + 1
and the target's state at t, and drafts the token at t + 2; its next draft step reads its own
state (`carry`) and its draft. What is carried follows SGLang: EAGLE-3 the layer's output before
its final norm, NEXTN after the shared head's norm.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from xlaserve.model.config.model_config import ModelConfig
from xlaserve.model.layers import MLP, Kernels, RMSNorm, init_weight, linear, matmul_input_dtype
from xlaserve.model.weight_types.packed import embed
from xlaserve.model.rope import traced_rope
from xlaserve.model.transformer import Attention, DecoderLayer


class DraftToTarget(nnx.Variable):
    """An integer table of a head (not a trained parameter): draft-vocabulary id -> target id."""


def eagle3_capture_layers(num_layers: int, given=None) -> tuple[int, ...]:
    """The target layers whose input an EAGLE-3 head reads: SGLang's default (2, L // 2, L - 3),
    or the checkpoint's `eagle_aux_hidden_state_layer_ids`, which name layers by their output
    (the input of the next one: SGLang adds one, as here)."""
    layers = (tuple(int(i) + 1 for i in given) if given
              else (2, num_layers // 2, num_layers - 3))
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"an EAGLE-3 head reads the inputs of 3 of the model's {num_layers} "
                         f"layers; got {list(layers)} (eagle_aux_hidden_state_layer_ids + 1)")
    return layers


class Eagle3Head(nnx.Module):
    def __init__(self, config: ModelConfig, target_hidden: int, draft_vocab: int,
                 capture_layers: tuple[int, ...], *, norm_before_residual: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        """`norm_before_residual` (the checkpoint's, vLLM's name): the layer's residual is the
        normed state, not the state."""
        c = config
        self.config = c
        self.capture_layers = tuple(capture_layers)
        self.norm_before_residual = norm_before_residual
        self.fc = nnx.Param(init_weight(rngs, (3 * target_hidden, c.hidden_size), dtype))
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)  # the embedding's
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.attn = Attention(c, 0, dtype, rngs, input_size=2 * c.hidden_size)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype, rngs)
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = nnx.Param(init_weight(rngs, (c.hidden_size, draft_vocab), dtype))
        self.draft_to_target = DraftToTarget(jnp.arange(draft_vocab, dtype=jnp.int32))

    def features(self, target, hidden, captured, kernels: Kernels) -> jax.Array:
        """The head's input state from a target step: fc of the captured layers' inputs."""
        del target, hidden
        x = jnp.concatenate(captured, axis=-1)
        return linear(x.astype(matmul_input_dtype(self.fc[...])), self.fc[...], kernels)

    def __call__(self, embedding, ids, state, positions, kv_cache, metadata, kernels: Kernels):
        """(the layer's output before the final norm [T, hidden], the KV cache)."""
        dtype = matmul_input_dtype(self.attn.input_matrix())
        e = embed(embedding, ids).astype(jnp.float32)
        state = state.astype(jnp.float32)
        normed_state = self.hidden_norm(state)
        residual = normed_state if self.norm_before_residual else state
        x = jnp.concatenate([self.input_norm(e), normed_state], axis=-1).astype(dtype)
        cos, sin = traced_rope(self.config, positions)
        attn_out, kv_cache = self.attn(x, cos, sin, kv_cache, metadata, kernels)
        norm = self.post_attention_norm
        x, normed = kernels.add_rms_norm(residual, attn_out, norm.factor(), norm.eps,
                                         self.mlp.input_dtype())
        return x + self.mlp(normed, kernels), kv_cache

    def carry(self, x: jax.Array) -> jax.Array:
        return x

    def draft(self, x: jax.Array, kernels: Kernels, target) -> jax.Array:
        """The greedy draft (a target id) of each row of layer outputs `x`. `target`: the
        model the head drafts for (a head may draft through its LM head: NextNHead's)."""
        return self.draft_to_target[...][greedy_ids(self, self.final_norm(x), kernels, target)]

    def draft_of_carry(self, carried: jax.Array, kernels: Kernels, target) -> jax.Array:
        """`draft` of the outputs whose `carry` this is (what a request's slot keeps)."""
        return self.draft(carried, kernels, target)

    def top_drafts_of_carry(self, carried: jax.Array, k: int, kernels: Kernels,
                            target) -> tuple[jax.Array, jax.Array]:
        """(target ids i32[T, k], their log-probabilities f32[T, k]): the `k` likeliest drafts
        of the outputs whose `carry` this is, likeliest first (tree drafting, runtime/executor/drafts/draft_tree.py)."""
        ids, logprobs = top_logprobs(self, self.final_norm(carried), k, kernels, target)
        return self.draft_to_target[...][ids], logprobs


class NextNHead(nnx.Module):
    def __init__(self, config: ModelConfig, *, shared_lm_head: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        """`config`: the target's, with one layer (`nextn_config`). `shared_lm_head`: drafts
        through the target's LM head (Qwen's MTP layer), not one of its own (DeepSeek's)."""
        c = config
        self.config = c
        self.capture_layers = ()
        # enorm, hnorm (Qwen: pre_fc_norm_embedding, pre_fc_norm_hidden), eh_proj (Qwen: fc)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        self.eh_proj = nnx.Param(init_weight(rngs, (2 * c.hidden_size, c.hidden_size), dtype))
        self.layer = DecoderLayer(c, 0, dtype, rngs)
        # shared_head.norm (Qwen: mtp.norm)
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, c.norm_offset)
        if not shared_lm_head:
            self.lm_head = nnx.Param(init_weight(rngs, (c.hidden_size, c.vocab_size), dtype))

    def features(self, target, hidden, captured, kernels: Kernels) -> jax.Array:
        """The target's final hidden state, normed (what SGLang's NEXTN reads)."""
        del captured, kernels
        return target.final_norm(hidden)

    def __call__(self, embedding, ids, state, positions, kv_cache, metadata, kernels: Kernels):
        dtype = matmul_input_dtype(self.eh_proj[...])
        e = self.enorm(embed(embedding, ids).astype(jnp.float32))
        x = jnp.concatenate([e, self.hnorm(state)], axis=-1).astype(dtype)
        x = linear(x, self.eh_proj[...], kernels)
        x, normed = self.layer.input_rms_norm(x, None, kernels)
        cos, sin = traced_rope(self.config, positions)
        x, mlp_out, kv_cache = self.layer(x, normed, cos, sin, kv_cache, metadata, kernels)
        return x + mlp_out, kv_cache

    def carry(self, x: jax.Array) -> jax.Array:
        return self.final_norm(x)

    def draft(self, x: jax.Array, kernels: Kernels, target) -> jax.Array:
        return greedy_ids(self, self.final_norm(x), kernels, target)

    def draft_of_carry(self, carried: jax.Array, kernels: Kernels, target) -> jax.Array:
        """`draft` of the outputs whose `carry` (their final norm) this is."""
        return greedy_ids(self, carried, kernels, target)

    def top_drafts_of_carry(self, carried: jax.Array, k: int, kernels: Kernels,
                            target) -> tuple[jax.Array, jax.Array]:
        """As Eagle3Head's: the `k` likeliest drafts (ids, log-probabilities) of a carry."""
        return top_logprobs(self, carried, k, kernels, target)


def nextn_config(target: ModelConfig) -> ModelConfig:
    """The multi-token-prediction layer's config: the target's, one layer, full attention (a
    hybrid's MTP layer is a full gated attention one), with experts when the target has them
    (SGLang's is_nextn layer is always sparse; Qwen's MTP layer is the target's MoE)."""
    full = target.cache_layers[0]  # a layer that attends: its KV heads' copies (tp)
    return dataclasses.replace(target, num_layers=1, sliding_windows=(None,),
                               moe_layers=(target.num_experts > 0,), linear_layers=(False,),
                               kv_replicas=target.kv_replicas[full:full + 1])


def lm_head_logits(head, normed: jax.Array, kernels: Kernels, target) -> jax.Array:
    """`head`'s LM head over `normed` rows (its final norm already applied): its own, or where
    it has none the target's (`target`: the model, its LM head or its tied embedding)."""
    if hasattr(head, "lm_head"):
        weight, transposed = head.lm_head[...], False
    elif target.config.tie_word_embeddings:
        weight, transposed = target.embedding[...], True
    else:
        weight, transposed = target.lm_head[...], False
    return linear(normed.astype(matmul_input_dtype(weight)), weight, kernels,
                  transposed=transposed)


def top_logprobs(head, normed: jax.Array, k: int, kernels: Kernels, target):
    """(ids i32[T, k] of the head's vocabulary, log-probabilities f32[T, k]): the `k` likeliest
    of `head`'s LM head over `normed` rows (its final norm already applied)."""
    logits = lm_head_logits(head, normed, kernels, target)
    logprobs, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), k)
    return ids.astype(jnp.int32), logprobs


def greedy_ids(head, normed: jax.Array, kernels: Kernels, target) -> jax.Array:
    """i32: the argmax of `head`'s LM head over each of `normed` rows (its final norm already
    applied; ids of the head's vocabulary)."""
    return jnp.argmax(lm_head_logits(head, normed, kernels, target), axis=-1).astype(jnp.int32)
