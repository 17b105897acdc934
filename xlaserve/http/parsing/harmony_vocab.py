"""The o200k vocabulary that `openai-harmony` renders gpt-oss prompts with, found without a network.

openai-harmony (OpenAI's library for gpt-oss's chat format) tokenizes with `o200k_harmony`: the
file `o200k_base.tiktoken` (199,998 byte strings by rank) plus the Harmony special tokens. Left to
itself it downloads that file on first use; it reads `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`
instead when the variable is set, checking the file's SHA-256. Servers often have no network, and
a server should not reach out at start-up, so `load_encoding` never lets it download; it takes:
1. `$TIKTOKEN_ENCODINGS_BASE`, when the user set it;
2. else the model's own tokenizer: gpt-oss's tokenizer.json IS o200k_harmony (ids = ranks,
   byte-level token strings), so the file is written back from it into a temporary folder and
   harmony loads that; harmony's hash check proves the file byte-exact.
A real gpt-oss checkpoint therefore needs nothing else; a model whose tokenizer is not o200k
(a tiny test model) needs the variable. Whether the model's tokenizer IS o200k_harmony is returned
too: then harmony's token ids are the model's own, and the prompt is those ids (a user's text that
spells `<|end|>` stays text, as harmony encodes it) rather than the text encoded again.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import tempfile

VOCAB_FILE = "o200k_base.tiktoken"
ENCODINGS_BASE = "TIKTOKEN_ENCODINGS_BASE"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # harmony's too
O200K_RANKS = 199_998  # byte strings before the first special token (<|startoftext|>)
# o200k_harmony's named special tokens (openai-harmony's src/tiktoken_ext/public_encodings.rs);
# the other ids up to 201087 are <|reserved_ID|>.
HARMONY_SPECIAL_IDS = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
                       "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
                       "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012}


def load_encoding(tokenizer=None):
    """(harmony's gpt-oss encoding, whether `tokenizer` is o200k_harmony), the vocabulary from
    `$TIKTOKEN_ENCODINGS_BASE` or else from `tokenizer` (the model's); neither is one ValueError
    that says what to do."""
    vocab = o200k_from_tokenizer(tokenizer) if tokenizer is not None else None
    if os.environ.get(ENCODINGS_BASE):
        return _load(os.environ[ENCODINGS_BASE], f"${ENCODINGS_BASE}"), vocab is not None
    if vocab is None:
        raise ValueError(f"gpt-oss chat needs the o200k vocabulary for openai-harmony and the "
                         f"model's tokenizer is not o200k_harmony: put {VOCAB_FILE} in a folder "
                         f"and set {ENCODINGS_BASE} to it (nothing is downloaded)")
    with tempfile.TemporaryDirectory(prefix="xlaserve-o200k-") as folder:
        with open(os.path.join(folder, VOCAB_FILE), "wb") as f:
            f.write(vocab)
        return _load(folder, "the model's tokenizer"), True


def _load(folder: str, source: str):
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    try:
        with _environment(ENCODINGS_BASE, folder):
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as error:  # no such file, or not o200k (its hash differs)
        raise ValueError(f"openai-harmony could not load {VOCAB_FILE} from {source} "
                         f"({folder}): {error}") from None


def o200k_from_tokenizer(tokenizer) -> bytes | None:
    """`o200k_base.tiktoken` (base64 of each token's bytes, a space, its rank, a newline) written
    back from a Hugging Face tokenizer of o200k_harmony; None when the tokenizer is not exactly
    that (its special tokens elsewhere, or other byte strings: the file's hash differs)."""
    vocab = tokenizer.get_vocab()
    if any(vocab.get(token) != id_ for token, id_ in HARMONY_SPECIAL_IDS.items()):
        return None
    by_id = {id_: token for token, id_ in vocab.items() if id_ < O200K_RANKS}
    if len(by_id) != O200K_RANKS:
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    lines = []
    for rank in range(O200K_RANKS):
        try:
            raw = bytes(byte_of[char] for char in by_id[rank])
        except KeyError:  # not a byte-level token string
            return None
        lines.append(base64.b64encode(raw) + b" %d\n" % rank)
    text = b"".join(lines)
    return text if hashlib.sha256(text).hexdigest() == O200K_SHA256 else None


@contextlib.contextmanager
def _environment(name: str, value: str):
    """`name=value` in this process's environment while loading (harmony reads only the
    environment), then as it was."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before
