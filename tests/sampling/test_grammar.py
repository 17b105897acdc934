"""The grammar backend (llguidance) and the sampler's bitmask: which tokens a mask allows, where
the request's stop ids come in, the errors that name their field, and that the jitted sampler
never picks a token outside the mask, greedy or sampled."""
import json

import numpy as np
import pytest

from xlaserve.weights.loader import default_model_file, load_tokenizer
from xlaserve.runtime.sampling.grammar import (CONSTRAINT_DEAD_END, GrammarBackend, allowed_tokens,
                                               self_only_reference)
from xlaserve.runtime.sampling.params import InvalidGrammar, RowSamplingParams, constraint_of
from xlaserve.runtime.sampling.sampler import sample
from xlaserve.runtime.sampling.params import build_sampling_metadata
from xlaserve.runtime.sampling.params import SamplingParams


EOS = 2  # <|im_end|> of the default model's tokenizer
LOGITS_WIDTH = 49152 + 100  # the logits cover 100 ids the tokenizer does not have


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_file())


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, LOGITS_WIDTH, [EOS])


def mask_of(backend, grammar):
    bitmask = backend.empty_bitmask(1)
    backend.fill_masks([(grammar, 0)], bitmask)
    return allowed_tokens(bitmask[0], LOGITS_WIDTH)


def feed(tokenizer, grammar, text):
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert grammar.consume(token), text


def test_a_regex_allows_exactly_the_tokens_that_continue_it(backend, tokenizer):
    grammar = backend.new_grammar("regex", "(Paris|London)")
    texts = {tokenizer.decode([t]) for t in mask_of(backend, grammar)}
    assert "Paris" in texts and "London" in texts and "P" in texts
    assert all("Paris".startswith(t) or "London".startswith(t) for t in texts)
    feed(tokenizer, grammar, "Paris")
    assert grammar.is_stopped()


def test_unconstrained_rows_allow_everything_and_the_vocabulary_tail_is_never_allowed(backend):
    assert len(allowed_tokens(backend.empty_bitmask(1)[0], LOGITS_WIDTH)) == LOGITS_WIDTH
    grammar = backend.new_grammar("json_schema", '{"type": "object"}')
    bitmask = backend.empty_bitmask(3)
    backend.fill_masks([(grammar, 1)], bitmask)
    assert (bitmask[[0, 2]] == -1).all()  # the other rows are untouched
    allowed = allowed_tokens(bitmask[1], LOGITS_WIDTH)
    assert allowed.max() < 49152 and 0 < len(allowed) < 49152


def test_stop_ids_are_allowed_exactly_where_the_grammar_accepts(backend, tokenizer):
    stop_ids = [EOS, 7, 49200]  # a template end-of-turn id; one in the tail is never allowed
    grammar = backend.new_grammar("regex", "[a-z]{2,}", stop_token_ids=stop_ids)
    feed(tokenizer, grammar, "a")
    assert not {EOS, 7} & set(mask_of(backend, grammar))  # "a" does not match yet
    feed(tokenizer, grammar, "b")
    allowed = set(mask_of(backend, grammar))
    assert {EOS, 7} <= allowed and 49200 not in allowed


def test_requests_of_one_grammar_have_independent_states(backend, tokenizer):
    first = backend.new_grammar("regex", "(ab|cd)")
    second = backend.new_grammar("regex", "(ab|cd)")
    feed(tokenizer, first, "ab")
    assert first.is_stopped() and not second.is_stopped()
    feed(tokenizer, second, "cd")
    assert second.is_stopped()


def test_a_token_outside_the_grammar_is_refused(backend, tokenizer):
    grammar = backend.new_grammar("regex", "[0-9]+")
    assert not grammar.consume(tokenizer.encode("x", add_special_tokens=False)[0])
    assert grammar.error()


@pytest.mark.parametrize("kind, text, says", [
    ("regex", "[a-", "unclosed character class"),
    ("regex", r"(a)\1", "regex parse error"),  # Rust's regex has no backreferences
    ("ebnf", "root ::= foo", "Rule 'foo' not found"),
    ("ebnf", 'root ::= ("a"', "invalid EBNF"),
    ("json_schema", "{bad", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"type": "strnig"}', "Invalid type: strnig"),
    ("json_schema", '{"type": "string", "format": "weird"}', "Unknown format: weird"),
    ("json_schema", '{"type": "string", "not": {"const": "a"}}', "not"),  # unsupported keyword
])
def test_bad_constraints_are_refused_naming_the_field(backend, kind, text, says):
    with pytest.raises(InvalidGrammar) as error:
        backend.new_grammar(kind, text)
    assert error.value.param == kind and says in str(error.value)


SELF_ONLY = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}  # issue 48's schema


@pytest.mark.parametrize("kind, text, says", [
    ("json_schema", json.dumps(SELF_ONLY), "'#/$defs/a' leads back to itself"),
    ("json_schema", json.dumps({"$ref": "#", "title": "me"}), "'#' leads back to itself"),
    ("json_schema", json.dumps({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                "$ref": "#/$defs/a"}), "leads back to itself"),
    # Nested where a model would reach it mid-answer: the first mask cannot see it.
    ("json_schema", json.dumps({"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                "$defs": {"a": {"$ref": "#/$defs/a"}}}), "leads back to itself"),
    ("json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable"),
    ("json_schema", json.dumps({"allOf": [{"type": "string"}, {"type": "integer"}]}),
     "Unsatisfiable"),
    # Grammars no text starts: refused by the first mask, whatever the kind.
    ("ebnf", "root ::= a\na ::= a", "nothing can start it"),
    ("regex", r"[^\s\S]", "nothing can start it"),
])
def test_constraints_no_output_satisfies_are_refused_naming_the_field(backend, kind, text, says):
    with pytest.raises(InvalidGrammar) as error:
        backend.new_grammar(kind, text)
    assert error.value.param == kind and says in str(error.value)


@pytest.mark.parametrize("schema", [
    {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
     "$ref": "#/$defs/node"},  # a linked list: recursive, but through a property
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "string"}}, "$ref": "#/$defs/a"},
    {"type": "array", "items": {"$ref": "#"}},
])
def test_references_that_reach_a_real_schema_are_kept(backend, schema):
    assert self_only_reference(schema) is None
    backend.new_grammar("json_schema", json.dumps(schema))


def test_a_stop_where_the_grammar_does_not_accept_is_a_dead_end(backend, tokenizer):
    """A part of a grammar that no text completes: llguidance's mask there allows only EOS."""
    grammar = backend.new_grammar("ebnf", 'root ::= "x" a | "y"\na ::= a')
    for token in tokenizer.encode("x", add_special_tokens=False):
        assert grammar.consume(token)
    bitmask = backend.empty_bitmask(1)
    backend.fill_masks([(grammar, 0)], bitmask)
    assert allowed_tokens(bitmask[0], backend.vocab_size).tolist() == [tokenizer.eos_token_id]
    assert not grammar.accepts()
    assert grammar.dead_end().startswith(CONSTRAINT_DEAD_END)


def test_two_constraints_at_once_name_the_second():
    params = SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(InvalidGrammar) as error:
        constraint_of(params)
    assert error.value.param == "ebnf"
    assert constraint_of(SamplingParams(json_schema="{}")) == ("json_schema", "{}")
    assert constraint_of(SamplingParams()) is None


def test_json_whitespace_is_bounded_by_default(backend, tokenizer):
    grammar = backend.new_grammar("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    feed(tokenizer, grammar, '{"a": ')
    spaces = [t for t in mask_of(backend, grammar) if tokenizer.decode([t]).isspace()]
    assert spaces == []  # one space was allowed after the colon, and it is used
    grammar = backend.new_grammar("json_schema", '{"type": "object"}')
    assert not any(tokenizer.decode([t]).strip() == "" and len(tokenizer.decode([t])) > 1
                   for t in mask_of(backend, grammar))  # no run of spaces or newlines


def test_a_whitespace_pattern_widens_what_json_allows(tokenizer):
    wide = GrammarBackend(tokenizer, LOGITS_WIDTH, [EOS], whitespace_pattern=r"[\n ]*")
    grammar = wide.new_grammar("json_schema", '{"type": "object"}')
    feed(tokenizer, grammar, "{")
    texts = {tokenizer.decode([t]) for t in mask_of(wide, grammar)}
    assert "\n" in texts and "  " in texts


# --- the sampler's mask ---------------------------------------------------------------------


def random_bitmask(rng, rows, vocab, keep):
    allowed = rng.random((rows, vocab)) < keep
    allowed[:, rng.integers(0, vocab, rows)] = True  # at least one token a row
    padded = np.zeros((rows, -(-vocab // 32) * 32), bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32), allowed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_and_greedy_tokens_never_leave_the_mask(temperature):
    rng = np.random.default_rng(0)
    rows, vocab = 8, 300
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 4
    bitmask, allowed = random_bitmask(rng, rows, vocab, keep=0.05)
    bitmask[5] = -1  # an unconstrained row beside constrained ones
    allowed[5] = True
    counts, prompt = np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), bool)
    for index in range(20):
        params = [RowSamplingParams(temperature=temperature, seed=i, sample_index=index,
                                    repetition_penalty=0.5, return_logprob=True)
                  for i in range(rows)]
        out = sample(logits, build_sampling_metadata(params, rows), counts, prompt,
                     token_bitmask=bitmask, num_top_logprobs=2)
        tokens = np.asarray(out.tokens)
        assert allowed[np.arange(rows), tokens].all()
        if temperature == 0:
            best = np.where(allowed, logits, -np.inf).argmax(axis=1)
            np.testing.assert_array_equal(tokens[:5], best[:5])
            assert tokens[5] == logits[5].argmax()


def test_an_all_ones_mask_changes_nothing():
    rng = np.random.default_rng(1)
    rows, vocab = 8, 300
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    counts, prompt = np.zeros((rows, vocab), np.int32), np.zeros((rows, vocab), bool)
    params = [RowSamplingParams(temperature=0.8, seed=i, return_logprob=True) for i in range(rows)]
    metadata = build_sampling_metadata(params, rows)
    plain = sample(logits, metadata, counts, prompt, num_top_logprobs=3)
    ones = sample(logits, metadata, counts, prompt,
                  token_bitmask=np.full((rows, -(-vocab // 32)), -1, np.int32), num_top_logprobs=3)
    np.testing.assert_array_equal(np.asarray(plain.tokens), np.asarray(ones.tokens))
    np.testing.assert_array_equal(np.asarray(plain.logprobs), np.asarray(ones.logprobs))


def test_objects_with_properties_allow_no_other_keys_unless_the_schema_says_so(backend, tokenizer):
    closed = backend.new_grammar("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}}))
    feed(tokenizer, closed, '{"a": 1')
    texts = {tokenizer.decode([t]) for t in mask_of(backend, closed)}
    assert "," not in texts and "}" in texts
    open_ = backend.new_grammar("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}))
    feed(tokenizer, open_, '{"a": 1')
    assert "," in {tokenizer.decode([t]) for t in mask_of(backend, open_)}


def test_a_json_schema_given_as_a_dict_is_its_json_text():
    assert constraint_of(SamplingParams(json_schema={"type": "object"})) == (
        "json_schema", '{"type": "object"}')
    with pytest.raises(InvalidGrammar, match="must be a string"):
        constraint_of(SamplingParams(regex=["a"]))


@pytest.mark.parametrize("pattern, text", [
    (r"^(Paris|London)$", "London"),
    (r"(?P<city>Paris|London)\Z", "Paris"),  # Python's named group and end of text
    (r"(?i)paris", "PARIS"),
    (r"\d{3}-\d{4}", "555-1234"),
])
def test_regexes_as_python_users_write_them(backend, tokenizer, pattern, text):
    grammar = backend.new_grammar("regex", pattern)
    feed(tokenizer, grammar, text)
    assert grammar.is_stopped()


def test_regex_features_rust_lacks_are_refused_by_name(backend):
    with pytest.raises(InvalidGrammar, match="lookarounds not supported"):
        backend.new_grammar("regex", r"\bword\b")


def test_a_structural_tag_constrains_only_the_tagged_segments(backend, tokenizer):
    tag = json.dumps({"triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "end": "</function>",
         "schema": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}]})
    grammar = backend.new_grammar("structural_tag", tag)
    feed(tokenizer, grammar, 'Any text at all. <function=get_weather>{"city": "Paris"}</function> more')
    assert not grammar.is_stopped()  # free text may go on
    bad = backend.new_grammar("structural_tag", tag)
    feed(tokenizer, bad, "ok <function=get_weather>")
    assert not all(bad.consume(t) for t in tokenizer.encode('{"town": "x"}', add_special_tokens=False))


def test_process_exit_waits_for_the_token_table_built_in_background():
    """A process that exits while llguidance builds the token table (a warm start answered and
    closed within a second) waits for it and exits cleanly: as a daemon thread it was ended inside
    llguidance's Rust code during finalization and crashed with SIGSEGV (docs/testing.md). The
    table is checked at exit, after the interpreter joined its threads."""
    import subprocess
    import sys
    script = (
        "import atexit\n"
        "from xlaserve.weights.loader import default_model_file, load_tokenizer\n"
        "from xlaserve.runtime.sampling.grammar import GrammarBackend\n"
        f"backend = GrammarBackend(load_tokenizer(default_model_file()), {LOGITS_WIDTH}, [{EOS}])\n"
        "atexit.register(lambda: print('table built at exit:', backend._token_table is not None))\n"
        "thread = backend.prepare_in_background()\n"
        "print('daemon:', thread.daemon)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["daemon: False", "table built at exit: True"]
