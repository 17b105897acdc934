"""Structured outputs: a request's JSON schema, regex or EBNF as a token mask per step, through
llguidance (the grammar library: Earley parser + lazy lexer, GBNF/Lark/regex/JSON schema).

    backend = GrammarBackend(tokenizer, vocab_size, eos_token_ids)
    grammar = backend.new_grammar("regex", "(Paris|London)")   # InvalidGrammar for a bad one
    bitmask = backend.empty_bitmask(rows)                      # i32[rows, ceil(V/32)], all ones
    backend.fill_masks([(grammar, row)], bitmask)              # the grammar's tokens in its row
    ... the step samples `token` under the mask ...
    grammar.consume(token); grammar.is_stopped()              # the scheduler, per sampled token

The bitmask's layout is llguidance's (and xgrammar's): token t is allowed iff bit t % 32 of word
t // 32 is set. Its width covers the logits (the config's vocab_size), so tokens past the
tokenizer's vocabulary but inside the logits are there, never allowed.

Measured on the default model's tokenizer (49152 tokens, 2-core Zen 4; benchmarks/bench_grammar.py):
the token table takes 0.3-0.5 s to build (once, on the first constrained request), a grammar
compiles in 1-6 ms (then cached by text; each request takes a deep copy, ~2 us), and a mask row
fills in 7-22 us in most states, ~140 us inside a string with maxLength.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from typing import Iterable, Sequence

import numpy as np

from xlaserve.runtime.sampling.params import InvalidGrammar

GRAMMAR_BACKENDS = ("llguidance", "none")
# JSON whitespace between tokens when --constrained-json-whitespace-pattern is not given: one
# optional space (outlines' and SGLang's default for their JSON grammars), so `{"a": 1}` and
# `{"a":1}` both parse but a small model cannot pad with spaces or newlines until max_tokens.
DEFAULT_JSON_WHITESPACE = r"[ ]?"
_CACHE_SIZE = 256  # compiled grammars kept, by (kind, text)
# Deepest nesting of a schema (objects and arrays) a constraint may have: far past any real
# schema, and short of the recursion limit of the code that walks one (ours, json, llguidance's
# conversion), where a schema 500 deep was a RecursionError.
MAX_JSON_DEPTH = 64
# The error of a request whose output reached a point its constraint cannot continue from (a
# part of the grammar that no text completes, such as a `$ref` nested in a property that only
# refers to itself): the engine ends it with this message rather than a "stop" whose text does
# not satisfy the constraint; the HTTP layer answers it with a 400 (http/errors.py).
CONSTRAINT_DEAD_END = "the output cannot be completed under its constraint"
# Keywords that say something about a schema without constraining its value.
_ANNOTATIONS = frozenset({"$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title",
                          "description", "default", "examples", "deprecated", "readOnly",
                          "writeOnly"})


def tiktoken_encoding(tokenizer):
    """The `tiktoken.Encoding` behind a slow tokenizer built on one (Kimi K2's remote-code
    `TikTokenTokenizer` keeps it as `.model`), which llguidance reads directly; else None."""
    encoding = getattr(tokenizer, "model", None)
    module = type(encoding).__module__ or ""
    return encoding if module.startswith("tiktoken") and not tokenizer.is_fast else None

def json_depth(value) -> int:
    """How deeply objects and arrays nest in `value` (a scalar: 0; counted level by level, not
    recursively, and only up to just past MAX_JSON_DEPTH)."""
    depth, level = 0, [value]
    while True:
        containers = [item for item in level if isinstance(item, (dict, list))]
        if not containers or depth > MAX_JSON_DEPTH:
            return depth
        depth += 1
        level = [child for item in containers
                 for child in (item.values() if isinstance(item, dict) else item)]


def parse_json(text: str, kind: str):
    """A constraint's JSON text, parsed strictly (no NaN, Infinity or numbers past a float, which
    Python's json reads and llguidance does not) and no deeper than MAX_JSON_DEPTH; else
    InvalidGrammar naming `kind`."""
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except (ValueError, RecursionError) as error:
        raise InvalidGrammar(kind, f"{kind} is not valid JSON: {_first_line(str(error))}") from None
    check_depth(value, kind)
    return value


def check_depth(value, what: str) -> None:
    """InvalidGrammar naming `what` for a value nested past MAX_JSON_DEPTH."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidGrammar(what, f"{what} nests objects and arrays more than {MAX_JSON_DEPTH} "
                                   "deep")


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of a number's range")
    return value


def self_only_reference(schema) -> str | None:
    """The first `$ref` of `schema` that leads, through schemas that are nothing but a `$ref`,
    back to itself (`{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}`): no value
    satisfies such a schema, and llguidance compiles it to a grammar that dead-ends where it is
    reached. None if there is none. Local references (`#...`) only; each chain is walked once."""
    def is_reference(node) -> bool:
        return (isinstance(node, dict) and isinstance(node.get("$ref"), str)
                and not set(node) - _ANNOTATIONS - {"$ref"})

    def target(ref: str):
        if ref != "#" and not ref.startswith("#/"):
            return None  # a remote or anchor reference: llguidance says if it cannot resolve it
        node = schema
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    ends: set[int] = set()  # reference nodes whose chain is known to end
    stack = [schema]
    while stack:  # every dict of the schema (depth already bounded by check_depth)
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        chain, current = [], node
        while is_reference(current) and id(current) not in ends:
            if any(current is seen for seen in chain):
                return current["$ref"]
            chain.append(current)
            current = target(current["$ref"])
        ends.update(id(seen) for seen in chain)
    return None


def python_regex_to_rust(pattern: str) -> str:
    """Python's end-of-text `\\Z` is `\\z` in the Rust syntax llguidance reads (named groups
    `(?P<name>...)`, classes, `(?i)` and the rest are common to both); what Rust lacks
    (lookarounds, backreferences, `\\b`) is refused when the grammar compiles, naming it."""
    return re.sub(r"(?<!\\)((?:\\\\)*)\\Z", r"\1\\z", pattern)


def closed_objects(schema):
    """The schema with `"additionalProperties": false` on every object schema that lists
    `properties` and says nothing about others: SGLang's default backend (xgrammar, strict mode)
    works so, and without it a small model keeps adding keys until max_tokens (SmolLM2 on the
    tutorial's capital schema appended "population_density", ... greedily)."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    if ("properties" in closed and "additionalProperties" not in closed
            and "patternProperties" not in closed and "unevaluatedProperties" not in closed):
        closed["additionalProperties"] = False
    return closed


class Grammar:
    """One request's position in its grammar. Only the engine thread touches it."""

    def __init__(self, matcher, stop_token_ids: Iterable[int] = ()):
        self.matcher = matcher
        # Request stop ids (EOS, a template's end-of-turn, the user's) are allowed exactly where
        # the grammar allows its EOS, i.e. where it accepts.
        self.stop_token_ids = sorted(set(stop_token_ids))

    def consume(self, token: int) -> bool:
        """Advances past a sampled token; False (and the grammar is in error) if it was not
        allowed."""
        return self.matcher.consume_token(int(token))

    def is_stopped(self) -> bool:
        """True once the grammar is complete and allows nothing more (e.g. after a JSON object's
        closing brace): the request ends with finish_reason "stop"."""
        return self.matcher.is_stopped()

    def error(self) -> str:
        return self.matcher.get_error()

    def accepts(self) -> bool:
        """Whether the output so far satisfies the constraint (it may still go on)."""
        return self.matcher.is_accepting()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar would take from here (a speculative
        draft is cut there: a verified row's tokens must each be allowed)."""
        return self.matcher.validate_tokens([int(t) for t in tokens])

    def states_after(self, drafts: list[int]) -> list["Grammar"]:
        """The grammar here and after each of `drafts` (copies; this one does not move): the
        state each sample row of a verified row is masked by. The drafts must be valid
        (`valid_prefix`)."""
        states, matcher = [self], self.matcher
        for token in drafts:
            matcher = matcher.deep_copy()
            if not matcher.consume_token(int(token)):
                raise ValueError(f"draft token {token} is not allowed: {matcher.get_error()}")
            states.append(Grammar(matcher, self.stop_token_ids))
        return states

    def dead_end(self) -> str:
        """The error of a request whose grammar no token continues (CONSTRAINT_DEAD_END)."""
        return (f"{CONSTRAINT_DEAD_END}: the output reached a point that no text completes "
                "(a part of the schema or grammar that nothing satisfies)")


class GrammarBackend:
    """Compiles constraints (cached by text) and fills masks; thread-safe where it needs to be:
    `new_grammar` runs on HTTP threads, the rest on the engine thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 whitespace_pattern: str | None = None):
        self.vocab_size = vocab_size  # the logits' width, which may pass the tokenizer's
        self.tokenizer_size = len(tokenizer)
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.whitespace_pattern = whitespace_pattern or DEFAULT_JSON_WHITESPACE
        self._tokenizer = tokenizer
        self._token_table = None
        self._lock = threading.Lock()
        self._executor = None
        self._compile = functools.lru_cache(maxsize=_CACHE_SIZE)(self._compile_uncached)

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    def token_table(self):
        """llguidance's view of the tokenizer (built once, on first use: ~0.3 s at 49K tokens)."""
        with self._lock:
            if self._token_table is None:
                import llguidance
                import llguidance.hf

                encoding = tiktoken_encoding(self._tokenizer)
                try:
                    if encoding is not None:
                        import llguidance.tiktoken

                        self._token_table = llguidance.tiktoken.lltokenizer_from_encoding(
                            encoding, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
                    else:
                        self._token_table = llguidance.hf.from_tokenizer(
                            self._tokenizer, n_vocab=self.vocab_size,
                            eos_token=self.eos_token_ids)
                except ValueError as error:  # a slow (sentencepiece-only) tokenizer
                    raise InvalidGrammar("", f"constrained decoding needs a fast tokenizer: {error}")
                self._executor = llguidance.LLExecutor()
            return self._token_table

    def prepare(self) -> None:
        """Builds the token table now (at start-up, in a thread); a tokenizer llguidance cannot
        take is reported when a constraint asks for it, not here."""
        try:
            self.token_table()
        except InvalidGrammar:
            pass

    def prepare_in_background(self) -> threading.Thread:
        """prepare() in a thread, before a request waits on the table. Not a daemon: the
        interpreter's exit waits for it (~0.3 s). As a daemon, a process that ended while
        llguidance built the table (a warm start, answered and closed within a second) died of a
        SIGSEGV: the thread, taking the GIL back from llguidance's Rust code during finalization,
        was ended by pthread_exit, whose unwinding through those frames crashed (gdb, 2026-11-29:
        the warm-restart crash of docs/testing.md, 1 start in 7 with both cores busy)."""
        thread = threading.Thread(target=self.prepare, name="xlaserve-grammar")
        thread.start()
        return thread

    def new_grammar(self, kind: str, text: str, stop_token_ids: Iterable[int] = ()) -> Grammar:
        """A fresh matcher for the constraint; raises InvalidGrammar for a bad one."""
        return Grammar(self._compile(kind, text).deep_copy(), stop_token_ids)

    def compile(self, kind: str, text: str) -> None:
        """Compiles the constraint into the cache (or raises InvalidGrammar)."""
        self._compile(kind, text)

    def _compile_uncached(self, kind: str, text: str):
        import llguidance

        table = self.token_table()
        if kind == "json_schema":
            schema = parse_json(text, kind)
            if not isinstance(schema, (dict, bool)):
                raise InvalidGrammar(kind, "json_schema must be a JSON object (a JSON schema)")
            _check_references(schema, kind)
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(closed_objects(schema)),
                    defaults={"whitespace_pattern": self.whitespace_pattern})
            except ValueError as error:  # e.g. a boolean schema, which takes no options
                raise InvalidGrammar(kind, f"invalid json_schema: {_first_line(str(error))}") from None
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(python_regex_to_rust(text))
        elif kind == "structural_tag":
            grammar = self._structural_tag_grammar(text)
        elif kind == "ebnf":
            try:
                grammar = llguidance.grammar_from("ebnf", text)
            except ValueError as error:
                raise InvalidGrammar(kind, f"invalid EBNF grammar: {error}") from None
        else:
            raise InvalidGrammar(kind, f"unknown constraint {kind!r}")
        # The constructor compiles; it reports grammar errors (bad regex, unsupported schema
        # keyword, undefined rule) as an error state, not an exception.
        matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidGrammar(kind, f"invalid {kind}: {_first_line(matcher.get_error())}")
        # A grammar whose start no text can follow (a schema that is only a reference to itself,
        # an empty language) dead-ends at its first mask: refused here, not answered with the
        # stop token that llguidance then allows. One mask, once per constraint text (cached).
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():  # its error is the parser's state dump, nothing a client can use
            raise InvalidGrammar(kind, f"no output satisfies this {kind}: nothing can start it")
        return matcher

    def _structural_tag_grammar(self, text: str) -> str:
        """SGLang's structural tag: free text in which each `begin` (from one of `triggers`)
        starts a segment whose body follows `schema`, closed by `end`; e.g. tool calls written
        as `<function=f>{...}</function>` inside an answer. Built with llguidance's StructTag:
        the text runs lazily up to a trigger, then the tag is constrained."""
        import llguidance

        spec = parse_json(text, "structural_tag")
        structures = spec.get("structures") if isinstance(spec, dict) else None
        triggers = spec.get("triggers") if isinstance(spec, dict) else None
        if not structures or not isinstance(structures, list) or not triggers \
                or not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
            raise InvalidGrammar("structural_tag", "structural_tag needs a list of structures "
                                 '({"begin", "schema", "end"}) and a list of triggers')
        tags = []
        for i, structure in enumerate(structures):
            if not isinstance(structure, dict) or not isinstance(structure.get("begin"), str) \
                    or not isinstance(structure.get("end"), str) \
                    or not isinstance(structure.get("schema"), dict):
                raise InvalidGrammar("structural_tag", f"structures[{i}] needs begin and end "
                                                       "strings and a schema object")
            trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
            if trigger is None:
                raise InvalidGrammar("structural_tag", f"structures[{i}].begin "
                                     f"{structure['begin']!r} starts with none of the triggers")
            _check_references(structure["schema"], "structural_tag")
            schema = {**closed_objects(structure["schema"]),
                      "x-guidance": {"whitespace_pattern": self.whitespace_pattern}}
            tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"],
                                             grammar=schema, end=structure["end"]))
        # Triggers are text here: `<tool_call>` is several tokens in most vocabularies.
        try:
            return llguidance.StructTag.to_grammar(tags, assume_special=False)
        except ValueError as error:
            raise InvalidGrammar("structural_tag",
                                 f"invalid structural_tag: {_first_line(str(error))}") from None

    def empty_bitmask(self, rows: int) -> np.ndarray:
        """i32[rows, words]: every token allowed (unconstrained and padding rows)."""
        return np.full((rows, self.words), -1, np.int32)

    def fill_masks(self, rows: list[tuple[Grammar, int]], bitmask: np.ndarray) -> None:
        """Writes each grammar's allowed tokens into its row of `bitmask` (in parallel, without
        the GIL), then its request's other stop ids where the grammar allows EOS."""
        if not rows:
            return
        import llguidance.numpy

        self.token_table()  # the executor
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(g.matcher, row) for g, row in rows], bitmask)
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        for grammar, row in rows:
            if eos is None or not grammar.stop_token_ids or not _bit(bitmask, row, eos):
                continue
            for token in grammar.stop_token_ids:
                if token < self.tokenizer_size:  # tokens past the tokenizer are never allowed
                    bitmask.view(np.uint32)[row, token >> 5] |= np.uint32(1 << (token & 31))


def _check_references(schema, kind: str) -> None:
    ref = self_only_reference(schema)
    if ref is not None:
        raise InvalidGrammar(kind, f"no value satisfies this {kind}: its $ref {ref!r} leads back "
                                   "to itself through references alone")


def _bit(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def _first_line(message: str) -> str:
    """llguidance's error on one line: without the echo of the grammar and the caret lines under
    it (`   1 | start: /[a-/`, `   ^`), at most 500 characters."""
    lines = [line.strip() for line in message.strip().splitlines()]
    kept = [line for line in lines
            if line and not re.match(r"^\d+ \|", line) and set(line) - set("^ ")]
    return " ".join(kept)[:500]


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (tests and debugging)."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)
