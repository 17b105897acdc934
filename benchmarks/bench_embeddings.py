"""Embeddings per second on the CPU against sentence-transformers (issue 54), side by side in one
process: the same random-weight model of a real one's shapes, the same texts, float32, their runs
alternated, the median of `--rounds`.

    .venv/bin/python benchmarks/bench_embeddings.py                        # all-MiniLM-L6-v2's shapes
    .venv/bin/python benchmarks/bench_embeddings.py --model qwen3-embedding-0.6b --texts 64

No checkpoint is downloaded: the model is built with transformers from the shapes below (random
weights) and saved as a sentence-transformers model with the pooling the real one has, with a
word-level tokenizer of the model's vocabulary size (`w0 w1 ...`; BERT's [CLS] ... [SEP] around
each text). Texts are `--min-words`..`--max-words` random words. sentence-transformers encodes in
batches of `--batch-size` (padded, as it does); xlaserve takes every text at once (its buckets).
The vectors of the two are compared too (max |difference|), so a fast wrong answer shows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_quantized_gemm import cpu_description  # noqa: E402

# Real models' shapes: (architecture, config fields, sentence-transformers pooling mode, normalize).
MODELS = {
    "all-minilm-l6-v2": ("bert", dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                                      num_attention_heads=12, vocab_size=30522,
                                      max_position_embeddings=512), "mean", True),
    "bge-base-en-v1.5": ("bert", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, vocab_size=30522,
                                      max_position_embeddings=512), "cls", True),
    "qwen3-embedding-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072,
                                           num_hidden_layers=28, num_attention_heads=16,
                                           num_key_value_heads=8, head_dim=128, vocab_size=151669,
                                           max_position_embeddings=32768,
                                           tie_word_embeddings=True), "lasttoken", True),
}


def build(directory: str, name: str) -> str:
    """The sentence-transformers model of `name`'s shapes in `directory` (module docstring)."""
    import tokenizers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    kind, shapes, mode, normalize = MODELS[name]
    torch.manual_seed(0)
    backbone = os.path.join(directory, "backbone")
    words = [f"w{i}" for i in range(shapes["vocab_size"] - 4)]
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocabulary = {word: i for i, word in enumerate(specials + words)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    if kind == "bert":
        transformers.BertModel(transformers.BertConfig(**shapes), add_pooling_layer=False
                               ).save_pretrained(backbone)
        tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    else:
        transformers.Qwen3Model(transformers.Qwen3Config(**shapes)).save_pretrained(backbone)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]",
                                         unk_token="[UNK]").save_pretrained(backbone)
    hidden = shapes["hidden_size"]
    modules = [models.Transformer(backbone, max_seq_length=512),
               models.Pooling(hidden, pooling_mode=mode)]
    model = SentenceTransformer(modules=modules + ([models.Normalize()] if normalize else []),
                                device="cpu")
    saved = os.path.join(directory, "st")
    model.save(saved)
    if kind == "qwen3":  # as Qwen3-Embedding ships: the backbone under a causal LM's config
        with open(os.path.join(saved, "config.json")) as f:
            config = json.load(f)
        config["architectures"] = ["Qwen3ForCausalLM"]
        with open(os.path.join(saved, "config.json"), "w") as f:
            json.dump(config, f)
    return saved


def texts_for(args, vocab_size: int) -> list[str]:
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_words, args.max_words + 1, args.texts)
    return [" ".join(f"w{i}" for i in rng.integers(0, vocab_size - 4, n)) for n in lengths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="all-minilm-l6-v2")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--min-words", type=int, default=16)
    parser.add_argument("--max-words", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--out", help="write the figures here as JSON")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from xlaserve.offline import Engine

    torch.set_num_threads(os.cpu_count() or 1)
    directory = tempfile.mkdtemp(prefix="bench-embeddings-")
    path = build(directory, args.model)
    texts = texts_for(args, MODELS[args.model][1]["vocab_size"])
    reference = SentenceTransformer(path, device="cpu")
    engine = Engine(path, is_embedding=True, dtype="float32",
                    max_running_requests=args.max_running_requests,
                    max_prefill_tokens=2048, chunked_prefill_size=2048)
    tokens = sum(len(engine.tokenizer.encode(t)) for t in texts)

    def ours():
        return np.array([o["embedding"] for o in engine.encode(texts)], np.float32)

    def theirs():
        with torch.inference_mode():
            return reference.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)

    difference = float(np.abs(ours() - theirs()).max())  # also the warm-up of both
    seconds = {"xlaserve": [], "sentence-transformers": []}
    for _ in range(args.rounds):
        for system, run in (("xlaserve", ours), ("sentence-transformers", theirs)):
            start = time.perf_counter()
            run()
            seconds[system].append(time.perf_counter() - start)
    engine.shutdown()
    rates = {system: args.texts / statistics.median(s) for system, s in seconds.items()}
    figures = {"model": args.model, "texts": args.texts, "tokens": tokens,
               "embeddings_per_s": rates,
               "ratio": rates["xlaserve"] / rates["sentence-transformers"],
               "max_abs_difference": difference, "rounds": args.rounds,
               "cpu": cpu_description()}
    print(json.dumps(figures, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
