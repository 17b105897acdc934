"""A checkpoint's tokenizer: whether a GGUF file or a directory carries one (`has_tokenizer`) and
loading it (`load_tokenizer`): the GGUF's own, the generic fast tokenizer without AutoTokenizer's
imports, or AutoTokenizer, with one-line errors for a directory without tokenizer files and for
tokenizer code the checkpoint ships (Kimi K2's) without --trust-remote-code or that does not
import."""
from __future__ import annotations

import json
import os

from xlaserve.weights.formats import gguf_file

# Files of the tokenizer formats AutoTokenizer reads (tokenizer.json, tokenizer_config.json,
# tokenizer.model, vocab.json + merges.txt, spiece.model, tekken.json, *.tiktoken, ...).
_TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "spiece", "tekken")
_TOKENIZER_FILE_SUFFIXES = (".model", ".tiktoken")
# Tokenizer classes that are PreTrainedTokenizerFast itself (TokenizersBackend in transformers 5).
_GENERIC_FAST_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


class MissingTokenizerError(FileNotFoundError):
    pass


def has_tokenizer(source: str) -> bool:
    """Whether a GGUF file or directory carries a tokenizer."""
    if source.endswith(".gguf"):
        return os.path.isfile(source)
    names = os.listdir(source) if os.path.isdir(source) else []
    return any(n.startswith(_TOKENIZER_FILE_PREFIXES) or n.endswith(_TOKENIZER_FILE_SUFFIXES)
               for n in names)


def load_tokenizer(source: str, trust_remote_code: bool = False):
    """The tokenizer of a GGUF file, a directory or a hub id; a directory without tokenizer files
    is a one-line error (AutoTokenizer's own is a long one about the hub)."""
    if source.endswith(".gguf") and os.path.isfile(source):
        return gguf_file.load_tokenizer(source)
    if os.path.isdir(source) and not has_tokenizer(source):
        raise MissingTokenizerError(
            f"{source} has no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...): "
            "pass --skip-tokenizer-init to send token ids instead of text, or --tokenizer-path")
    tokenizer_config = _tokenizer_config(source)
    if _generic_fast_tokenizer(source, tokenizer_config):
        # The class AutoTokenizer would pick, without AutoTokenizer's imports: they pull in torch
        # through transformers' config machinery (3.9 s against 0.9 s on a 2-core CPU).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(source)
    remote_class = _remote_tokenizer_class(tokenizer_config)
    if remote_class and not trust_remote_code:
        raise ValueError(f"{source}'s tokenizer is Python code shipped with the checkpoint "
                         f"({remote_class}): pass --trust-remote-code to let transformers run it")
    import transformers
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except ImportError as error:
        if not remote_class:
            raise
        # The checkpoint's code was written for another transformers (or needs a package).
        raise ValueError(f"{source}'s tokenizer code ({remote_class}) does not import with "
                         f"transformers {transformers.__version__}: {error}") from None


def _tokenizer_config(directory: str) -> dict:
    """A local checkpoint's tokenizer_config.json, or {} (none, unreadable, or a hub id)."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            tokenizer_config = json.load(f)
    except (OSError, ValueError):
        return {}
    return tokenizer_config if isinstance(tokenizer_config, dict) else {}


def _remote_tokenizer_class(tokenizer_config: dict) -> str | None:
    """The "module.Class" of the tokenizer code a checkpoint ships (tokenizer_config.json's
    auto_map, as Kimi K2's `tokenization_kimi.TikTokenTokenizer`), or None."""
    auto_map = tokenizer_config.get("auto_map") or {}
    classes = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if isinstance(classes, str):
        classes = [classes]
    return next((name for name in classes or [] if isinstance(name, str)), None)


def _generic_fast_tokenizer(directory: str, tokenizer_config: dict) -> bool:
    """Whether `directory` holds a tokenizer.json whose tokenizer_config.json names the generic
    fast tokenizer class (and no custom code)."""
    return (tokenizer_config.get("tokenizer_class") in _GENERIC_FAST_TOKENIZERS
            and "auto_map" not in tokenizer_config
            and os.path.isfile(os.path.join(directory, "tokenizer.json")))
