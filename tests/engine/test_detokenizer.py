"""Incremental detokenization: whole characters only, stop strings trimmed and held back."""
import pytest

from xlaserve.weights.formats.gguf_file import load_tokenizer
from xlaserve.weights.loader import default_model_file
from xlaserve.runtime.engine.detokenizer import IncrementalDetokenizer


TEXT = "Hello world! Ça va? 東京は日本の首都です 🎉🐍 done.\nNew line  two spaces"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_file())  # byte-level BPE: emoji span several tokens


def _stream(detok, ids):
    pieces = [detok.append(t) for t in ids]
    pieces.append(detok.finish())
    return pieces


def test_pieces_join_to_the_full_decode_and_never_split_a_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # multi-byte characters really span tokens
    pieces = _stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)


def test_first_output_word_keeps_its_space_after_the_prompt(tokenizer):
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    output = tokenizer.encode("The answer is forty two", add_special_tokens=False)[len(prompt):]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    assert "".join(_stream(detok, output)) == " forty two"


def test_stop_string_across_tokens_is_trimmed_and_reported(tokenizer):
    ids = tokenizer.encode("Count: one, two, three, four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["three", "zzz"])
    pieces = _stream(detok, ids)
    assert detok.matched_stop == "three"
    assert "".join(pieces) == detok.text == "Count: one, two, "


def test_partial_stop_match_is_held_back_then_released(tokenizer):
    ids = tokenizer.encode("abc</answ", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["</answer>"])
    pieces = [detok.append(t) for t in ids]
    assert "".join(pieces) == "abc"  # "</answ" could still become the stop string
    assert detok.finish() == "</answ"  # it never did: the end of the output releases it
    assert detok.matched_stop is None


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("x = 1; y = 2; END trailing", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop_strings=["END"], no_stop_trim=True)
    assert "".join(_stream(detok, ids)) == "x = 1; y = 2; END"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(_stream(IncrementalDetokenizer(tokenizer), ids)) == "hi"
    kept = "".join(_stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids))
    assert kept == "hi" + tokenizer.eos_token


class _WordPieceLike:
    """A tokenizer whose `decode` post-processes the backend's text, as transformers' WordPiece
    clean-up does: the detokenizer must keep calling `decode`, not the backend."""

    clean_up_tokenization_spaces = True

    def __init__(self, inner):
        self.backend_tokenizer = inner.backend_tokenizer
        self.inner = inner

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens).replace(" !", "!")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_direct_backend_decode_gives_what_the_tokenizer_decode_gives(tokenizer, skip_special_tokens):
    import random
    rng = random.Random(0)
    ids = [rng.randrange(len(tokenizer)) for _ in range(400)] + tokenizer.all_special_ids
    rng.shuffle(ids)
    pieces = _stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens), ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer):
    ids = tokenizer.encode("wow ! really !", add_special_tokens=False)
    pieces = _stream(IncrementalDetokenizer(_WordPieceLike(tokenizer)), ids)
    assert "".join(pieces) == "wow! really!"
