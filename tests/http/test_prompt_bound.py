"""The characters-per-token bound behind refusing a huge prompt untokenized: a bound for the
pipelines that keep every character, none where a stage can swallow text."""
import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from xlaserve.http.prompt_bound import chars_per_token

VOCAB = {"a": 0, "b": 1, "ab": 2, "abab": 3, "<unk>": 4}  # the longest entry: 5 characters
MERGES = [("a", "b"), ("ab", "ab")]


class _Wrapped:
    """What transformers wraps around a Rust tokenizer, as far as the bound looks."""

    def __init__(self, backend_tokenizer=None):
        if backend_tokenizer is not None:
            self.backend_tokenizer = backend_tokenizer


def _tokenizer(normalizer=None, pre_tokenizer=None, fuse_unk=False, added=(), truncation=False):
    tokenizer = Tokenizer(models.BPE(VOCAB, MERGES, unk_token="<unk>", fuse_unk=fuse_unk))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.add_tokens(list(added))
    if truncation:
        tokenizer.enable_truncation(8)
    return _Wrapped(tokenizer)


@pytest.mark.parametrize("kwargs,bound", [
    ({}, 5),
    ({"pre_tokenizer": pre_tokenizers.ByteLevel()}, 5),
    ({"pre_tokenizer": pre_tokenizers.Split(" ", "isolated")}, 5),
    ({"normalizer": normalizers.NFC()}, 20),  # up to 4 code points compose into one
    ({"normalizer": normalizers.Sequence([normalizers.Prepend("_"), normalizers.Replace(" ", "_")])}, 5),
    ({"normalizer": normalizers.Replace("aaaa", "b")}, 20),
    ({"added": [AddedToken("<|a very long marker|>")]}, 22),
    ({"normalizer": normalizers.Strip()}, None),
    ({"normalizer": normalizers.Replace(" ", "")}, None),
    ({"pre_tokenizer": pre_tokenizers.WhitespaceSplit()}, None),
    ({"pre_tokenizer": pre_tokenizers.Split(" ", "removed")}, None),
    ({"fuse_unk": True}, None),
    ({"added": [AddedToken("<m>", rstrip=True)]}, None),
    ({"truncation": True}, None),
], ids=lambda value: str(value)[:40])
def test_the_bound_or_none(kwargs, bound):
    assert chars_per_token(_tokenizer(**kwargs)) == bound


def test_no_bound_without_a_fast_tokenizer():
    assert chars_per_token(_Wrapped()) is None
