"""The offline Python API, shaped like SGLang's `sglang.Engine` so users can switch:

    engine = xlaserve.Engine(model_path=None, max_running_requests=16)
    out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    outs = engine.generate(["a", "b"], [{"temperature": 0}, {"temperature": 0.8, "seed": 1}])
    engine.shutdown()   # or use `with xlaserve.Engine(...) as engine:`

    # A model's shapes with random weights (SGLang's --load-format dummy), token ids in and out:
    engine = xlaserve.Engine(model_path="benchmarks/configs/qwen2.5-0.5b", load_format="dummy",
                             skip_tokenizer_init=True)
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8})

    # Two replicas of a 4-device tensor parallel model on 8 devices (runtime/engine/data_parallel.py):
    engine = xlaserve.Engine(model_path=..., tp_size=4, dp_size=2)
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
from typing import Any, AsyncIterator, Iterable, Iterator

from xlaserve.runtime.engine.async_requests import (LIVENESS_POLL_S, AsyncRequestGroup, Choice,
                                             EngineDeadError, sglang_output)
from xlaserve.runtime.engine.data_parallel import make_engine_core
from xlaserve.runtime.engine.image_prompts import images_per_prompt, read_image
from xlaserve.runtime.engine.messages import OutputDelta
from xlaserve.runtime.engine.weight_updates import WeightUpdateError
from xlaserve.runtime.sampling.params import InvalidSamplingParam, SamplingParams
from xlaserve.server_args import ServerArgs, platform_defaults

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@dataclasses.dataclass(frozen=True)
class LogprobOptions:
    """What logprobs a request returns: SGLang's return_logprob, top_logprobs_num and
    logprob_start_len (0: every prompt token too; None or -1: the output only); and whether its
    hidden states too (return_hidden_states: runtime/engine/hidden_states.py)."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int | None = None
    return_hidden_states: bool = False

    def __post_init__(self):
        if self.logprob_start_len not in (None, -1, 0):
            raise ValueError(f"logprob_start_len={self.logprob_start_len} is not supported: "
                             "0 (from the first prompt token) or -1 / None (output only)")

    @property
    def on(self) -> bool:
        return bool(self.return_logprob or self.top_logprobs_num)

    def submit_kwargs(self) -> dict:
        return dict(return_logprob=self.return_logprob, top_logprobs_num=self.top_logprobs_num,
                    return_prompt_logprob=self.on and self.logprob_start_len == 0,
                    return_hidden_states=self.return_hidden_states)


def to_sampling_params(params: dict | SamplingParams | None) -> tuple[SamplingParams, int]:
    """SGLang-style dict -> (SamplingParams, n). Unknown keys are an error, not ignored."""
    if isinstance(params, SamplingParams):
        return params, 1
    if not isinstance(params, (dict, type(None))):
        raise InvalidSamplingParam("sampling_params", "sampling_params must be an object")
    params = dict(params or {})
    n = params.pop("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidSamplingParam("n", "n must be an integer >= 1")
    unknown = set(params) - _SAMPLING_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling parameters: {[k[:40] for k in sorted(unknown)[:10]]}")
    return SamplingParams(**params), n


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any):
        self.server_args = ServerArgs(model_path=model_path, **server_args)
        platform_defaults.prepare_gpu_memory()  # before JAX starts a GPU client, if it has not
        if self.server_args.nnodes > 1:  # multi-host (runtime/distributed/leader.py): jax.distributed first
            from xlaserve.runtime.distributed import follower, setup

            setup.initialize(self.server_args)
            if self.server_args.node_rank > 0:  # a follower replays rank 0's steps, then exits
                raise SystemExit(follower.follow(self.server_args))
        # An EngineCore, or with dp_size > 1 replicas behind one (runtime/engine/data_parallel.py).
        self.core = make_engine_core(self.server_args)
        self.tokenizer = self.core.tokenizer

    # --- inputs -------------------------------------------------------------------------------

    def _requests(self, prompt, sampling_params, input_ids, lora_path=None, image_data=None
                  ) -> tuple[list[tuple[list[int], SamplingParams, str | None, object]], bool]:
        """Flatten prompts x n into (prompt_ids, params, LoRA adapter, prompt_images) tuples; also
        say whether input was a list. `lora_path`: an adapter's name for every prompt, or a list
        (None: the base model). `image_data`: a vision model's images (`_with_images`)."""
        id_lists, batched = self._id_lists(prompt, input_ids)
        prompt_images = self._with_images(id_lists, image_data, batched)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(id_lists)
        if len(params) != len(id_lists):
            raise ValueError(f"{len(params)} sampling_params for {len(id_lists)} prompts")
        adapters = lora_path if isinstance(lora_path, list) else [lora_path] * len(id_lists)
        if len(adapters) != len(id_lists):
            raise ValueError(f"{len(adapters)} lora_path entries for {len(id_lists)} prompts")
        requests = []
        for ids, p, adapter, images in zip(id_lists, params, adapters, prompt_images, strict=True):
            parsed, n = to_sampling_params(p)
            for i in range(n):
                # Each of n samples needs its own seed, or they would all draw the same tokens.
                seed = None if parsed.seed is None else parsed.seed + i
                requests.append((ids, dataclasses.replace(parsed, seed=seed), adapter, images))
        return requests, batched or len(requests) > 1

    def _with_images(self, id_lists: list[list[int]], image_data, batched: bool) -> list:
        """Each prompt's PromptImages (None without images), its ids expanded in place.
        `image_data` (SGLang's): per prompt an image or a list of them (PIL images, bytes, file
        paths, data: URLs), or one image or list for a single prompt; a prompt holds one image
        placeholder (<|image_pad|>) per image, as its chat template writes them."""
        if image_data is None or self.core.features.images is None:
            if image_data is not None:
                raise ValueError("image_data needs a vision-language model whose images this "
                                 "server runs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
            return [None] * len(id_lists)
        prompt_images = []
        for i, images in enumerate(images_per_prompt(image_data, len(id_lists), batched)):
            id_lists[i], prompt = self.core.features.images.prepare(id_lists[i],
                                                           [read_image(x) for x in images])
            prompt_images.append(prompt)
        return prompt_images

    def _id_lists(self, prompt, input_ids, lowercase: bool = False
                  ) -> tuple[list[list[int]], bool]:
        """The prompts (a text or a list; `lowercase`d first where asked) or token id lists as
        token id lists, and whether a list was given."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            batched = not isinstance(prompt, str)
            prompts = list(prompt) if batched else [prompt]
            if self.tokenizer is None:
                raise ValueError("text prompts need the tokenizer (started with skip_tokenizer_init)")
            return [self.tokenizer.encode(p.lower() if lowercase else p) for p in prompts], batched
        batched = bool(input_ids) and isinstance(input_ids[0], (list, tuple))
        return ([list(x) for x in input_ids] if batched else [list(input_ids)]), batched

    # --- embeddings (an embedding model, --is-embedding) -----------------------------------------

    def encode(self, prompt=None, input_ids=None):
        """SGLang's `Engine.encode`: the embedding of one text (or token id list), or of each of
        a list of them; a dict `{"embedding": [float], "meta_info": {...}}` or a list of them.
        Texts are tokenized with the model's special tokens (as sentence-transformers does) and
        lowercased first where the checkpoint says so. Needs an embedding model
        (`is_embedding=True`, or a checkpoint with sentence-transformers' modules.json); a
        classifier's (a reward model's) `embedding` is its head's logits, as SGLang's."""
        pooling = self.core.features.pooling
        id_lists, batched = self._id_lists(prompt, input_ids,
                                           lowercase=pooling is not None and pooling.lowercase)
        sinks = []
        for ids in id_lists:
            sink: queue.Queue[OutputDelta] = queue.Queue()
            self.core.submit(ids, SamplingParams(), sink.put, embed=True)
            sinks.append(sink)
        head = self.core.features.classifier_head
        results = []
        for sink in sinks:
            output = next(iter(self._drain(sink)))  # an embedding request's one output
            meta_info = output.finish.meta_info()
            if output.error is not None:
                meta_info["error"] = output.error
            vector = output.embedding
            if vector is not None and head is not None:
                vector = head.logits(vector[None])[0]
            results.append({"embedding": None if vector is None else vector.tolist(),
                            "meta_info": meta_info})
        return results if batched else results[0]

    # --- generation -----------------------------------------------------------------------------

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 top_logprobs_num=0, logprob_start_len=None, lora_path=None, image_data=None,
                 return_hidden_states=False):
        """SGLang's `Engine.generate`: one prompt (or token id list) and a dict of sampling
        params, or lists of them; returns a dict or a list of dicts with `text`, `output_ids` and
        `meta_info` (with `return_logprob`: `output_token_logprobs` [(logprob, token_id, None)]
        and, with `top_logprobs_num`, `output_top_logprobs`; with `logprob_start_len=0` too,
        `input_token_logprobs` [(logprob | None, token_id, None)] for every prompt token, the
        first None, and with `top_logprobs_num`, `input_top_logprobs`). `lora_path`: a loaded
        LoRA adapter's name, or one per prompt (None: the base model). `image_data`: a vision
        model's images, per prompt (`_with_images`). `return_hidden_states` (an engine made with
        `enable_return_hidden_states=True`): `meta_info["hidden_states"]`, SGLang's list of the
        last layer's hidden states after the final norm, an entry per output token: the prompt's
        rows [prompt][hidden] with the first, then the row [hidden] of the token before each
        later one (runtime/engine/hidden_states.py)."""
        logprobs = LogprobOptions(return_logprob, top_logprobs_num, logprob_start_len,
                                  return_hidden_states)
        requests, batched = self._requests(prompt, sampling_params, input_ids, lora_path,
                                           image_data)
        sinks = []
        for ids, params, adapter, prompt_images in requests:
            sink: queue.Queue[OutputDelta] = queue.Queue()
            self.core.submit(ids, params, sink.put, **logprobs.submit_kwargs(),
                             lora_path=adapter,
                             **({"prompt_images": prompt_images} if prompt_images else {}))
            sinks.append(sink)
        results = [self._collect(self._drain(sink), logprobs) for sink in sinks]
        return results if batched else results[0]

    def _drain(self, sink: queue.Queue[OutputDelta]) -> Iterator[OutputDelta]:
        """The outputs of one request as they come; raises if the engine loop has died, which
        would otherwise leave the caller waiting forever."""
        while True:
            try:
                yield sink.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                self._check_alive()

    def _check_alive(self) -> None:
        if not self.core.is_alive():
            raise EngineDeadError(self.core.stopped_reason())

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             return_logprob=False, top_logprobs_num=0, stream=False,
                             logprob_start_len=None, lora_path=None, image_data=None,
                             return_hidden_states=False):
        logprobs = LogprobOptions(return_logprob, top_logprobs_num, logprob_start_len,
                                  return_hidden_states)
        # A vision model's images run its tower: off the event loop.
        requests, batched = await asyncio.to_thread(self._requests, prompt, sampling_params,
                                                    input_ids, lora_path, image_data)
        if stream:
            if batched:
                raise ValueError("stream=True takes one prompt")
            ids, params, adapter, prompt_images = requests[0]
            return self._stream(ids, params, logprobs, adapter, prompt_images)
        results = await asyncio.gather(*[self._collect_async(ids, params, logprobs, adapter,
                                                             prompt_images)
                                         for ids, params, adapter, prompt_images in requests])
        return list(results) if batched else results[0]

    async def _outputs(self, ids, params, logprobs, adapter=None,
                       prompt_images=None) -> AsyncIterator[OutputDelta]:
        group = AsyncRequestGroup(self.core)
        group.submit(0, ids, params, **logprobs.submit_kwargs(), lora_path=adapter,
                     **({"prompt_images": prompt_images} if prompt_images else {}))
        try:
            async for _, output in group.outputs():
                yield output
        finally:
            group.abort()  # a no-op once finished; else the consumer went away: free the slot now

    async def _stream(self, ids, params, logprobs, adapter=None, prompt_images=None
                      ) -> AsyncIterator[dict]:
        """SGLang's stream dicts: each output's text delta, its token ids and `finished`, with the
        final one's `meta_info` (with return_hidden_states, all of them: `generate`'s); a
        speculative verified row's tokens (`OutputDelta.more`) in one."""
        text, token_ids, hidden = "", [], []
        async for output in self._outputs(ids, params, logprobs, adapter, prompt_images):
            text += output.text
            token_ids += [] if output.token_id is None else [output.token_id]
            if output.hidden_states is not None:
                hidden.append(output.hidden_states)
            if output.more:
                continue
            out = {"text": text, "output_ids": token_ids, "finished": output.finished}
            if output.finished:
                out["meta_info"] = output.finish.meta_info()
                if hidden:
                    out["meta_info"]["hidden_states"] = [entry.tolist() for entry in hidden]
            yield out
            text, token_ids = "", []

    async def _collect_async(self, ids, params, logprobs, adapter=None, prompt_images=None) -> dict:
        return self._collect([c async for c in self._outputs(ids, params, logprobs, adapter,
                                                             prompt_images)], logprobs)

    @staticmethod
    def _collect(outputs: Iterable[OutputDelta], logprobs: LogprobOptions) -> dict:
        choice = Choice(0, 0)
        for output in outputs:
            choice.add(output)
            if output.finished:
                break
        return sglang_output(choice, logprobs.return_logprob, logprobs.top_logprobs_num)

    # --- LoRA adapters (SGLang's Engine methods) -------------------------------------------------

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serves the PEFT adapter at `lora_path` as `lora_name` (no compile)."""
        self.core.load_lora_adapter(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stops serving `lora_name` once its requests have ended."""
        self.core.unload_lora_adapter(lora_name)

    # --- RL rollouts (SGLang's Engine methods; runtime/engine/weight_updates.py) -----------------

    def update_weights(self, params, flush_cache: bool = True, abort_all_requests: bool = False,
                       weight_version: str | None = None) -> None:
        """Serves a JAX trainer's weights, in process: an NNX state (or module) of xlaserve's
        model, or {Hugging Face name: array} of every weight. Its arrays are cast, put on the
        serving shardings (by XLA, on the devices) and swapped in between steps: no compile.
        Running requests end on the old weights first (`abort_all_requests`: they are aborted).
        Raises WeightUpdateError (the old weights serve on)."""
        self._weights().update(params, flush_cache=flush_cache,
                               abort_all_requests=abort_all_requests,
                               weight_version=weight_version)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None,
                                 flush_cache: bool = True) -> tuple[bool, str, int]:
        """(success, message, num_paused_requests), as SGLang's."""
        return self._answer(lambda w: w.update_from_disk(
            model_path, load_format, abort_all_requests=abort_all_requests,
            weight_version=weight_version, flush_cache=flush_cache), "from disk")

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None,
                                   flush_cache: bool = True, abort_all_requests: bool = False,
                                   weight_version: str | None = None) -> tuple[bool, str]:
        """SGLang's: `named_tensors` [(Hugging Face name, tensor)] (torch, NumPy or JAX
        arrays), every weight at once or in buckets over several calls (the weights change
        when the last arrives). (success, message)."""
        if load_format not in (None, "direct"):
            return False, f"load_format {load_format!r}: only direct named tensors are read"
        try:
            awaited = self._weights().update_named(
                dict(named_tensors), flush_cache=flush_cache,
                abort_all_requests=abort_all_requests, weight_version=weight_version)
        except WeightUpdateError as error:
            return False, str(error)
        return True, awaited or "Succeeded to update model weights from tensors."

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._weights().weight(name, truncate_size)

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._weights().release(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._weights().resume(tags)

    def pause_generation(self, mode: str = "abort") -> None:
        self._weights().pause(mode)

    def continue_generation(self) -> None:
        self._weights().resume_generation()

    def flush_cache(self) -> int:
        """Empties the prefix cache of pages no running request uses; returns how many."""
        return self.core.flush_cache()

    def _weights(self):
        weights = getattr(self.core, "weights", None)
        if weights is None:
            raise WeightUpdateError("the RL calls are not built with --dp-size > 1")
        return weights

    def _answer(self, update, what: str) -> tuple:
        """SGLang's (success, message, num_paused_requests) of an update."""
        try:
            paused = update(self._weights())
        except WeightUpdateError as error:
            return False, str(error), 0
        return True, f"Succeeded to update model weights {what}.", paused

    # --- lifetime ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
