"""An embedding server's requests, steps and vectors (issue 54): the request an input becomes
(`pooled_request`), each step's token types (`token_types`), the vectors finished on the host
from the steps' chunks (`PooledOutputs`), and the steps the engine loop runs (`PooledSteps`).

The step returns each prompt chunk's rows reduced (model/pooling.reduce_chunks): its first row,
its row sum or its last row. A prompt longer than a step's tokens runs in several chunks, so here
the CLS vector is the first chunk's, the mean is the chunks' sums over the prompt's length, the
last token's is the last chunk's; then L2 normalisation where the checkpoint has a Normalize
module, in float32 as torch's `F.normalize` (max(norm, 1e-12)).

A request's chunks arrive in order, but one that is retracted (the KV pool ran out) runs its
prompt again from a position it had reached before: chunks are kept by where they start, and a
chunk drops the kept ones that start at or after it. CLS and mean pooling read every row, so
their requests reuse no cached prefix (EngineCore.submit); last-token pooling may.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

from xlaserve.model.pooling import NORMALIZE_EPS
from xlaserve.runtime.engine.messages import PooledResult
from xlaserve.runtime.executor.forward_batch import forward_batch_for
from xlaserve.runtime.sampling.params import RowSamplingParams
from xlaserve.runtime.scheduler.pooled import process_pooled
from xlaserve.runtime.scheduler.request import Pooled, Request, ScheduledBatch
from xlaserve.server_args import ServerArgs, hf_overrides, pooler_config, reranker_tokens
from xlaserve.weights.classifier_head import ClassifierHead, checkpoint_head, token_logit_head
from xlaserve.weights.loader import LoadedModel
from xlaserve.weights.pooling import MODULES_FILE, Pooling, read_pooling

logger = logging.getLogger(__name__)


class WrongKindOfServer(ValueError):
    """An embedding request to a server that generates, or a generation to an embedding one."""


GENERATES = ("this server generates text: embeddings need an embedding model served with "
             "--is-embedding")
EMBEDS = "this server serves an embedding model (--is-embedding): it generates no text"
# EngineCore.submit's `prompt_images` on a server without a vision model, or not from
# images.prepare.
IMAGES_NEED_A_VISION_MODEL = ("images need a vision model, and the prompt their placeholders "
                              "expanded (images.prepare)")


def pooled_request(rid: str, prompt_ids: list[int], pooling: Pooling, priority: int = 0,
                   second_segment: int = 0) -> Request:
    """An embedding request for the scheduler: no tokens to sample (max_new_tokens 0); CLS and
    mean pooling read every row, so no cached prefix (module docstring)."""
    return Request(rid=rid, prompt_ids=prompt_ids, max_new_tokens=0,
                   sampling=RowSamplingParams(temperature=0.0, seed=0), priority=priority,
                   pooled=Pooled(second_segment),
                   no_prefix_reuse=pooling.mode != "last")


def token_types(batch, tokens: int) -> np.ndarray:
    """i32[tokens] of an embedding step: 1 for the tokens of a cross-encoder pair's second text
    (`Pooled.second_segment`), else 0."""
    types = np.zeros(tokens, np.int32)
    start = 0
    for request, chunk in zip(batch.requests, batch.chunks):
        n = len(chunk.token_ids)
        if request.pooled.second_segment:
            types[start:start + n] = np.arange(chunk.num_cached, chunk.num_cached + n) >= \
                request.pooled.second_segment
        start += n
    return types


def finish_vector(pooling: Pooling, reduced: list[np.ndarray], prompt_tokens: int) -> np.ndarray:
    """float32 [hidden]: a prompt's embedding from its chunks' reduced rows, in order."""
    if pooling.mode == "mean":
        vector = np.sum(reduced, axis=0, dtype=np.float32) / np.float32(prompt_tokens)
    else:
        vector = np.asarray(reduced[0 if pooling.mode == "cls" else -1], np.float32)
    if pooling.normalize:
        vector = vector / max(np.float32(np.linalg.norm(vector)), np.float32(NORMALIZE_EPS))
    return vector.astype(np.float32)


class PooledOutputs:
    """Each unfinished request's chunks so far (the engine loop's alone)."""

    def __init__(self, pooling: Pooling):
        self.pooling = pooling
        # rid -> (the request, {chunk start: its rows reduced})
        self._chunks: dict[str, tuple[Request, dict[int, np.ndarray]]] = {}

    def take(self, batch: ScheduledBatch, reduced: np.ndarray, running: list[int],
             ended: list[int]) -> list[tuple[Request, np.ndarray]]:
        """Keeps the step's chunks of the `running` rows (those of requests still running
        when it was read) and returns (request, embedding) for the `ended` ones among them,
        which finished their prompt."""
        for i in running:
            request, start = batch.requests[i], batch.chunks[i].num_cached
            kept = self._chunks.setdefault(request.rid, (request, {}))[1]
            for old in [s for s in kept if s >= start]:  # a retracted request's second run
                del kept[old]
            kept[start] = reduced[i]
        done = []
        for i in ended:
            request = batch.requests[i]
            kept = self._chunks.pop(request.rid)[1]
            done.append((request, finish_vector(self.pooling, [kept[s] for s in sorted(kept)],
                                                len(request.prompt_ids))))
        # A request aborted between its chunks: its chunks go with it.
        for rid in [rid for rid, (r, _) in self._chunks.items() if r.status != "running"]:
            del self._chunks[rid]
        return done

    def __len__(self) -> int:
        return len(self._chunks)


class PooledSteps:
    """An embedding server's steps (steps.GenerationSteps' counterpart, built at start-up): prompt
    chunks with no penalty state and no sampling; a step's rows come back reduced, and the
    requests whose prompt it ended leave with their vectors."""

    overlaps = False  # no step continues the last one: each is scheduled from its results

    def __init__(self, runner, buckets, scheduler, pooling: Pooling, token_types: bool):
        """`token_types`: the model takes each token's segment (an encoder's cross-encoder
        pairs: `token_types`)."""
        self.runner, self.buckets, self.scheduler = runner, buckets, scheduler
        self.token_types = token_types
        self.outputs = PooledOutputs(pooling)

    def check_kind(self, embed: bool, prompt_images=None, prompt_len: int = 0) -> None:
        """An embedding request, without images (GenerationSteps.check_kind's counterpart)."""
        if prompt_images is not None:
            raise ValueError(IMAGES_NEED_A_VISION_MODEL)
        if not embed:
            raise WrongKindOfServer(EMBEDS)

    def between_steps(self) -> None:
        pass

    def stage(self, batch: ScheduledBatch):
        fb = forward_batch_for(batch, self.buckets, self.runner.page_size)
        slots = np.zeros(fb.shape[1], np.int32)
        slots[:len(batch.slots)] = batch.slots
        return self.runner.stage(fb, slots, token_types(batch, fb.shape[0])
                                 if self.token_types else None)

    def send(self, batch: ScheduledBatch, staged):
        return self.runner.run(staged)

    def read(self, batch: ScheduledBatch, out) -> PooledResult:
        """The requests the step finished, with their vectors."""
        reduced = np.asarray(out)
        running = [i for i, r in enumerate(batch.requests) if r.status == "running"]
        ended = process_pooled(self.scheduler, batch)
        return PooledResult(self.outputs.take(batch, reduced, running, ended))


def pooling_of(args: ServerArgs, loaded: LoadedModel) -> tuple[Pooling, ClassifierHead | None]:
    """An embedding server's pooling, read from the checkpoint's sentence-transformers files
    (weights/pooling.py; PoolingConfigError naming what cannot be applied; a decoder without
    them pools its last token, normalized), --pooler-config's choices over it; or a
    classifier's head (weights/classifier_head.py: a cross-encoder or encoder classifier reads
    its first token's row, a decoder classifier or reward model its last)."""
    folder = loaded.source if os.path.isdir(loaded.source) else os.path.dirname(loaded.source)
    if (tokens := reranker_tokens(args)) is not None:  # --hf-overrides: a decoder reranker
        architecture = hf_overrides(args)["architectures"][0]
        body = architecture.replace("ForSequenceClassification", "ForCausalLM")
        if body != loaded.config.architecture or loaded.tokenizer is None:
            raise ValueError(f"--hf-overrides {architecture}: the checkpoint is a "
                             f"{loaded.config.architecture}, not a {body} (with its tokenizer)")
        logger.info("Reranker: %s scores pairs by the %s / %s logits of its last token",
                    architecture, *tokens)
        return (Pooling("last", normalize=False),
                token_logit_head(folder, loaded.config, loaded.tokenizer, tokens))
    if (classifier := checkpoint_head(folder, loaded.config)) is not None:
        mode, head = classifier
        if pooler_config(args):
            raise ValueError("--pooler-config: a classifier's head reads the token it was "
                             f"trained on (its {'first' if mode == 'cls' else 'last'}), pooled "
                             "no other way")
        logger.info("Classifier: %d label%s (%s), read from its %s token by its head; "
                    "/classify's activation: %s", len(head.labels),
                    "" if len(head.labels) == 1 else "s", ", ".join(head.labels[:8]),
                    "first" if mode == "cls" else "last", head.activation)
        return Pooling(mode, normalize=False), head
    chosen = pooler_config(args)
    if os.path.isfile(os.path.join(folder, MODULES_FILE)) or (
            loaded.config.encoder is not None and "mode" not in chosen):
        # As its sentence-transformers files say (an encoder without them: read_pooling's
        # refusal, naming them), with --pooler-config's choices over them.
        pooling = dataclasses.replace(read_pooling(folder, loaded.config.hidden_size), **chosen)
        source = "the checkpoint's sentence-transformers files"
    else:  # a decoder without them: its last token, normalized, as SGLang and vLLM pool it
        pooling = Pooling(**{"mode": "last", "normalize": True, **chosen})
        source = "a decoder without sentence-transformers files: last token, normalized"
    logger.info("Pooling: %s%s%s (%s%s)", pooling.mode,
                ", normalized" if pooling.normalize else "",
                ", inputs lowercased" if pooling.lowercase else "", source,
                "; --pooler-config over them" if chosen else "")
    return pooling, None
