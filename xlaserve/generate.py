"""python -m xlaserve.generate --prompt "..." : generate offline, no server.

Until the engine (continuous batching and sampling) lands, this decodes greedily.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from xlaserve.server_args import ServerArgs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xlaserve.generate", description=__doc__)
    parser.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    if server_args.skip_tokenizer_init:
        parser.error("--skip-tokenizer-init: this command takes text, so it needs the tokenizer")
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")

    from xlaserve.model.loader import load_model
    from xlaserve.runtime.compilation import enable_persistent_cache
    from xlaserve.runtime.greedy import greedy_generate

    enable_persistent_cache(server_args.compilation_cache_dir)
    loaded = load_model(server_args.model_path, dtype=server_args.dtype,
                        tokenizer_path=server_args.tokenizer_path)
    tokenizer = loaded.tokenizer
    if args.raw or not tokenizer.chat_template:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_dict=False)
    stop_ids = set(loaded.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    start = time.perf_counter()
    output_ids = greedy_generate(loaded.model, prompt_ids, args.max_new_tokens,
                                 page_size=server_args.page_size, stop_token_ids=tuple(stop_ids),
                                 attention_backend=server_args.attention_backend)
    elapsed = time.perf_counter() - start
    finished_by_stop = bool(output_ids) and output_ids[-1] in stop_ids
    text = tokenizer.decode(output_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({
            "text": text, "output_ids": output_ids,
            "meta_info": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids),
                          "finish_reason": "stop" if finished_by_stop else "length",
                          "e2e_latency": round(elapsed, 3)},
        }))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
