"""What an FP8 KV cache costs in quality on the embedded default model (SmolLM2-135M-Instruct):
the mean negative log-likelihood of a fixed English text (perplexity = e^NLL), each token scored
by the model over every earlier token's K and V as the cache holds them, with the cache in the
model's dtype (`auto`), e4m3 and e5m2; and how often each FP8 cache's most likely next token is
the `auto` cache's. float32 activations (--quantized-activations float32), so the cache is the
only difference. The default model has no KV cache scales: K and V are stored unscaled (its K
entries reach ~18 and V ~8, far inside either format's range).

    .venv/bin/python benchmarks/fp8_kv_quality.py [--json]

tests/engine/test_fp8_kv_cache_engine.py holds the differences under the bounds docs/server.md
explains.
"""
from __future__ import annotations

import argparse
import json
import math

from xlaserve.offline import Engine

TEXT = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour, and for more "
    "than a century its keepers had written down the weather twice a day. The old logbooks, "
    "bound in cracked leather, recorded the direction of the wind, the height of the swell and "
    "the names of the ships that passed. When the light was automated, the books were carried "
    "to the town library, where a retired schoolteacher began to read them one winter. She "
    "noticed that the storms of the early years came mostly from the south-west, while in "
    "later decades they arrived from the north more often than before. She counted them by "
    "hand, month by month, and drew the totals on squared paper. The pattern was not a proof "
    "of anything, she told the small audience that came to hear her talk in the spring, but it "
    "was a question worth asking. A fisherman in the front row said that his grandfather had "
    "always claimed the winters were harder when he was young, and that nobody had believed "
    "him. Another listener asked whether the keepers had been careful, and whether a tired man "
    "on a cold night might have written north when he meant north-west. The schoolteacher "
    "agreed that this was possible. She had found pages where the ink had run, and one entry "
    "where a keeper had written only that the sea was angry and he was tired of it. Still, "
    "she said, a hundred years of small observations made by patient people were worth more "
    "than a single clever guess. The library now lends the logbooks to students, who compare "
    "them with the records of ships and with the measurements taken by the weather service, "
    "and every year a few more pages are typed into a shared table so that anyone can read "
    "them.")

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


def score(kv_cache_dtype: str, text: str = TEXT) -> tuple[list[float], list[int], int]:
    """(each token's log-probability after the first, the most likely token at each position,
    the number of tokens) of `text` under the default model with that KV cache."""
    with Engine(None, kv_cache_dtype=kv_cache_dtype, quantized_activations="float32",
                max_total_tokens=2048, context_length=1024, chunked_prefill_size=512,
                max_running_requests=1, precompile_token_paddings="8,512",
                log_level="warning") as engine:
        ids = engine.tokenizer.encode(text)
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1,
                                                              "temperature": 0},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
    logprobs = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    top = [entries[0][1] for entries in out["meta_info"]["input_top_logprobs"][1:]]
    return logprobs, top, len(ids)


def measure(text: str = TEXT) -> dict:
    """Per KV cache dtype: mean NLL (nats a token), perplexity, the mean and largest absolute
    difference of a token's log-probability from `auto`'s, and top-1 agreement with `auto`."""
    scored = {kv: score(kv, text) for kv in KV_CACHE_DTYPES}
    base_logprobs, base_top, tokens = scored["auto"]
    results = {"tokens": tokens}
    for kv, (logprobs, top, _) in scored.items():
        nll = -sum(logprobs) / len(logprobs)
        diffs = [abs(a - b) for a, b in zip(logprobs, base_logprobs)]
        results[kv] = {"nll": nll, "perplexity": math.exp(nll),
                       "mean_abs_logprob_diff": sum(diffs) / len(diffs),
                       "max_abs_logprob_diff": max(diffs),
                       "top1_agreement": sum(a == b for a, b in zip(top, base_top)) / len(top)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    results = measure()
    if parser.parse_args().json:
        print(json.dumps(results, indent=2))
        return
    print(f"{results['tokens']} tokens of text, SmolLM2-135M-Instruct (GGUF), float32 activations")
    print("| KV cache | NLL (nats/token) | perplexity | mean / max |logprob diff| vs auto | "
          "top-1 agreement |")
    print("|---|---|---|---|---|")
    for kv in KV_CACHE_DTYPES:
        r = results[kv]
        print(f"| {kv} | {r['nll']:.4f} | {r['perplexity']:.3f} | "
              f"{r['mean_abs_logprob_diff']:.4f} / {r['max_abs_logprob_diff']:.3f} | "
              f"{r['top1_agreement']:.1%} |")


if __name__ == "__main__":
    main()
