"""The speculative-decoding flags of ServerArgs resolved (`resolve_speculative`, which
ServerArgs.__post_init__ calls): vLLM's --speculative-config JSON onto SGLang's flags, the
defaults that depend on one another (a chain's or a tree's row of tokens), and the bounds;
anything not built stops start-up naming it. Functions of the arguments object, which they
change in place."""
from __future__ import annotations

import json


def resolve_speculative(args) -> None:
    """vLLM's --speculative-config onto SGLang's flags, the default draft length, and the
    bounds; anything not built stops start-up naming it."""
    if args.speculative_config:
        _apply_speculative_config(args, args.speculative_config)
    if args.speculative_algorithm is None:
        return
    algorithm = args.speculative_algorithm
    if algorithm == "EAGLE":  # SGLang's EAGLE runs EAGLE-3 heads too; EAGLE-1/2 are refused
        algorithm = args.speculative_algorithm = "EAGLE3"  # by the head's architecture
    needs_path = algorithm in ("STANDALONE", "EAGLE3")
    if needs_path != bool(args.speculative_draft_model_path):
        raise ValueError("--speculative-draft-model-path goes with --speculative-algorithm "
                         "STANDALONE (a draft model) or EAGLE3 (its head), and they need it; "
                         "NEXTN reads the model's own checkpoint")
    _resolve_draft_steps(args, algorithm)
    if args.speculative_num_draft_tokens is None:
        args.speculative_num_draft_tokens = 5
    if args.speculative_num_draft_tokens < 2:
        raise ValueError("--speculative-num-draft-tokens must be 2 or more (the last token "
                         f"and a draft); got {args.speculative_num_draft_tokens}")
    low = args.speculative_ngram_min_match_window_size
    high = args.speculative_ngram_max_match_window_size
    if not 1 <= low <= high:
        raise ValueError("--speculative-ngram-min-match-window-size and -max- must satisfy "
                         f"1 <= min <= max; got {low} and {high}")
    if args.speculative_disable_by_batch_size is None:
        args.speculative_disable_by_batch_size = 32
    if args.speculative_disable_by_batch_size < 1:
        raise ValueError("--speculative-disable-by-batch-size must be 1 or more; got "
                         f"{args.speculative_disable_by_batch_size}")


def _resolve_draft_steps(args, algorithm: str) -> None:
    """SGLang's EAGLE flags: --speculative-num-steps, which sets a chain's row tokens (steps
    + 1), and --speculative-eagle-topk, which makes the drafts a tree (`_resolve_tree`)."""
    head = algorithm in ("EAGLE3", "NEXTN")
    if not head and (args.speculative_num_steps is not None
                     or args.speculative_eagle_topk is not None):
        raise ValueError("--speculative-num-steps and --speculative-eagle-topk go with "
                         "--speculative-algorithm EAGLE3 or NEXTN")
    if args.speculative_eagle_topk is not None and args.speculative_eagle_topk < 1:
        raise ValueError("--speculative-eagle-topk must be 1 or more; got "
                         f"{args.speculative_eagle_topk}")
    if (args.speculative_eagle_topk or 1) > 1:
        _resolve_tree(args)
        return
    steps = args.speculative_num_steps
    if steps is None:
        return
    if steps < 1:
        raise ValueError(f"--speculative-num-steps must be 1 or more; got {steps}")
    if args.speculative_num_draft_tokens not in (None, steps + 1):
        raise ValueError(f"--speculative-num-steps {steps} with --speculative-eagle-topk 1 "
                         f"makes rows of {steps + 1} tokens; --speculative-num-draft-tokens "
                         f"says {args.speculative_num_draft_tokens}")
    args.speculative_num_draft_tokens = steps + 1


def _resolve_tree(args) -> None:
    """Tree drafting (EAGLE3, NEXTN): a beam of topk paths `steps` deep (default 3), of which
    --speculative-num-draft-tokens - 1 nodes (default all, to 32 tokens a row) are verified."""
    topk = args.speculative_eagle_topk
    steps = args.speculative_num_steps = args.speculative_num_steps or 3
    if steps < 1 or topk * steps > 32:
        raise ValueError(f"--speculative-eagle-topk {topk} x --speculative-num-steps {steps} "
                         "must be 1 to 32 (a tree row's tokens are an int32 mask's bits)")
    tokens = args.speculative_num_draft_tokens
    if tokens is None:
        tokens = args.speculative_num_draft_tokens = min(topk * steps + 1, 32)
    if not 2 <= tokens <= min(topk * steps + 1, 32):
        raise ValueError(f"--speculative-num-draft-tokens {tokens}: a tree of topk {topk} "
                         f"and {steps} steps verifies 2 to {min(topk * steps + 1, 32)} tokens "
                         "(its root and its likeliest nodes)")


def _apply_speculative_config(args, text: str) -> None:
    try:
        config = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--speculative-config is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError("--speculative-config must be a JSON object")
    keys = {"method": "speculative_algorithm", "model": "speculative_draft_model_path",
            "num_speculative_tokens": "speculative_num_draft_tokens",
            "prompt_lookup_min": "speculative_ngram_min_match_window_size",
            "prompt_lookup_max": "speculative_ngram_max_match_window_size",
            "disable_by_batch_size": "speculative_disable_by_batch_size"}
    if unknown := sorted(set(config) - set(keys)):
        raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported "
                         f"(supported: {', '.join(keys)})")
    for key, value in config.items():
        if key == "method":
            value = {"draft_model": "STANDALONE", "deepseek_mtp": "NEXTN",
                     "mtp": "NEXTN"}.get(value, str(value).upper())
        elif key == "model":
            value = str(value)
        elif not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"--speculative-config: {key} must be an integer; got {value!r}")
        elif key == "num_speculative_tokens":
            value += 1  # vLLM counts drafted tokens; SGLang's flag, the row's tokens
        setattr(args, keys[key], value)
