"""python -m xlaserve.generate --prompt "..." : generate offline through the engine, no server."""
from __future__ import annotations

import argparse
import json
import sys
import time

from xlaserve.server_args import ServerArgs, configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlaserve.generate", description=__doc__)
    parser.add_argument("--prompt", required=True, action="append",
                        help="a user message (or raw text with --raw); repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as error:
        parser.error(str(error))
    if server_args.skip_tokenizer_init:
        parser.error("--skip-tokenizer-init: this command takes text, so it needs the tokenizer")
    configure_logging(server_args.log_level)

    from xlaserve.offline import Engine

    # One-shot use runs a handful of shapes: compiling them on first use beats precompiling all;
    # and the KV cache only needs room for these prompts (a context's worth each at most).
    fields = {k: v for k, v in vars(server_args).items() if k not in ("model_path", "disable_precompile")}
    if fields["max_total_tokens"] is None:
        fields["max_total_tokens"] = len(args.prompt) * (args.max_new_tokens + 4096)
    with Engine(server_args.model_path, disable_precompile=True, **fields) as engine:
        tokenizer = engine.tokenizer
        if args.raw or not tokenizer.chat_template:
            input_ids = [tokenizer.encode(p) for p in args.prompt]
        else:
            input_ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                       add_generation_prompt=True, return_dict=False)
                         for p in args.prompt]
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                  "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
        start = time.perf_counter()
        results = engine.generate(input_ids=input_ids, sampling_params=params)
        elapsed = time.perf_counter() - start
    for result in results:
        if args.json:
            result["meta_info"]["e2e_latency"] = round(elapsed, 3)
            print(json.dumps(result))
        else:
            print(result["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
