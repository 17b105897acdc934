"""What does not combine: one table (`CONFLICTS`) of the flags each kind of server does not run
with, and the one function that enforces it (`refuse_conflicts`).

A `Mode` is what a server is or does: an embedding server, a vision-language one, one with LoRA
adapters... Some are known from the flags alone (ServerArgs.__post_init__ refuses their conflicts
as the arguments are made); the others only once the model is read (an embedding checkpoint under
--runner auto, a vision tower: runtime/engine/startup.py) or when the processes join
(--nnodes > 1: runtime/distributed/setup.py, runtime/engine/data_parallel.py). Each pair of
flags is listed once, under the mode whose refusal names it.

What is not a pair stays with its area's dataclass: a value's range (--hicache-ratio), a default
that depends on another flag (a speculative tree's row), a flag that needs another one to mean
anything (--speculative-draft-model-path).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable


class Mode(enum.Enum):
    """What a server is or does that some flags do not run with (the values say what each is;
    the refusals' words are CONFLICTS')."""

    RERANKER = "a decoder reranker (--hf-overrides classifier_from_token)"
    IS_EMBEDDING = "--is-embedding"
    LORA = "--enable-lora (or --lora-paths)"
    EMBEDDINGS = "an embedding or scoring server (--is-embedding, --runner pooling, a checkpoint)"
    HIERARCHICAL_CACHE = "--enable-hierarchical-cache"
    VISION = "a vision-language model"
    MULTI_HOST = "--nnodes > 1"
    HIDDEN_STATES = "--enable-return-hidden-states"
    DETERMINISTIC = "--enable-deterministic-inference"
    LINEAR_ATTENTION = "a hybrid linear-attention model (Qwen3.5, Qwen3-Next, Nemotron-H)"


@dataclasses.dataclass(frozen=True)
class Refused:
    """A flag as a refusal names it (`name`, formatted with the arguments' fields, so that it can
    say the value given) and whether the arguments give it."""
    name: str
    given: Callable[[Any], bool]

    def named(self, args) -> str:
        return self.name.format_map(vars(args))


SPECULATION = Refused("--speculative-algorithm", lambda args: bool(args.speculative_algorithm))
LORA = Refused("--enable-lora", lambda args: args.enable_lora)
MULTI_HOST = Refused("--nnodes > 1", lambda args: args.nnodes > 1)
RUNNER_GENERATE = Refused("--runner generate", lambda args: args.runner == "generate")

# mode -> (the refusal, `{flag}` standing for the first of the flags after it that is given).
# The messages are matched word for word by tests and scripts: change them with those.
CONFLICTS: dict[Mode, tuple[str, tuple[Refused, ...]]] = {
    Mode.RERANKER: (
        "--hf-overrides classifier_from_token with {flag}: a reranker scores, it does not "
        "generate", (RUNNER_GENERATE,)),
    Mode.IS_EMBEDDING: ("--is-embedding with {flag}: give one", (RUNNER_GENERATE,)),
    Mode.LORA: ("--enable-lora with {flag} is not supported", (
        SPECULATION,
        Refused("--dp-size > 1", lambda args: args.dp_size > 1),
        MULTI_HOST)),
    Mode.EMBEDDINGS: (
        "{flag} with an embedding model (--is-embedding / --runner pooling): not supported", (
            SPECULATION,
            LORA,
            MULTI_HOST,
            Refused("--kv-cache-dtype {kv_cache_dtype}",
                    lambda args: args.kv_cache_dtype != "auto"),
            Refused("--enable-return-hidden-states",
                    lambda args: args.enable_return_hidden_states))),
    Mode.HIERARCHICAL_CACHE: ("--enable-hierarchical-cache with {flag}: not supported", (
        Refused("--disable-radix-cache", lambda args: args.disable_radix_cache),
        SPECULATION,
        MULTI_HOST,
        Refused("--is-embedding / --runner pooling", lambda args: args.runner == "pooling"))),
    Mode.VISION: ("{flag} with a vision-language model: not supported", (
        SPECULATION,
        LORA,
        MULTI_HOST,
        Refused("--quantization", lambda args: bool(args.quantization)))),
    Mode.MULTI_HOST: (
        "{flag} runs replicas inside one process; across hosts, run one server per replica "
        "group and put a router (sglang_router) in front", (
            # != 1: a size under 1 is refused here too, before the engine would say so
            Refused("--dp-size > 1", lambda args: args.dp_size != 1),)),
    Mode.HIDDEN_STATES: ("--enable-return-hidden-states with {flag} is not supported", (
        SPECULATION,
        MULTI_HOST)),
    Mode.DETERMINISTIC: ("--enable-deterministic-inference with {flag} is not built", (
        SPECULATION,
        LORA,
        MULTI_HOST,
        Refused("--tp-size > 1", lambda args: args.tp_size > 1),
        Refused("--matmul-backend xla", lambda args: args.matmul_backend == "xla"),
        Refused("--attention-backend reference",
                lambda args: args.attention_backend == "reference"),
        Refused("--is-embedding / --runner pooling", lambda args: args.runner == "pooling"))),
    # Each is a state the linear layers do not keep yet (issue 76): a draft model's or an
    # EAGLE-3 head's (NGRAM drafts on the host, NEXTN with the checkpoint's MTP layer, a full
    # attention one; the target's verified rows roll back: verified_rows.StateRollback), a tree's
    # (a state follows one path), an adapter's delta in their projections, a state per cached
    # prefix in host memory.
    Mode.LINEAR_ATTENTION: ("{flag} with a hybrid linear-attention model is not built yet", (
        Refused("--speculative-algorithm {speculative_algorithm}",
                lambda args: bool(args.speculative_algorithm)
                and args.speculative_algorithm not in ("NGRAM", "NEXTN")),
        Refused("--speculative-eagle-topk {speculative_eagle_topk} (a tree of drafts)",
                lambda args: (args.speculative_eagle_topk or 1) > 1),
        LORA,
        MULTI_HOST,
        Refused("--enable-hierarchical-cache", lambda args: args.enable_hierarchical_cache),
        Refused("--enable-deterministic-inference",
                lambda args: args.enable_deterministic_inference),
        Refused("--is-embedding / --runner pooling", lambda args: args.runner == "pooling"))),
}


def refuse_conflicts(args, mode: Mode) -> None:
    """Stops start-up (ValueError naming it) at the first flag in `args` that a server in `mode`
    does not run with. The caller knows the server is in `mode`."""
    message, flags = CONFLICTS[mode]
    for refused in flags:
        if refused.given(args):
            raise ValueError(message.format(flag=refused.named(args)))
