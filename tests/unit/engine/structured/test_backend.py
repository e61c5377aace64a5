"""GrammarBackend: llguidance's reasons for invalid constraints, the compile cache, the timeout."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.params import Constraint, ConstraintKind
from engine.structured.backend import GrammarBackend
from engine.structured.grammars import grammar_from_constraint


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object",'), "constraint.json_schema: not valid JSON: Expecting property name enclosed in double quotes: line 1 column 19 (char 18)"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": 5}'), "constraint.json_schema: type must be a string or array of strings"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"$ref": "#/$defs/missing"}'), "constraint.json_schema: Pointer '/$defs/missing' does not exist"),
        (Constraint(ConstraintKind.JSON_SCHEMA, "[1]"), "constraint.json_schema: a JSON Schema is an object or a boolean, got list"),
        (Constraint(ConstraintKind.JSON_SCHEMA, "false"), "constraint.json_schema: the schema false allows no value"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "string", "minLength": 3, "maxLength": 2}'), "constraint.json_schema: Unsatisfiable schema: minLength (3) is greater than maxLength (2)"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"not": {"type": "string"}}'), 'constraint.json_schema: Unimplemented keys: ["not"]'),
        (Constraint(ConstraintKind.REGEX, "[a-"), "constraint.regex: at 1(8): invalid regex"),
        (Constraint(ConstraintKind.REGEX, "(?=a)b"), 'constraint.regex: at 1(8): invalid regex "(?=a)b" (in regex): regex parse error:\n    (?=a)b\n    ^^^\nerror: look-around'),
        (Constraint(ConstraintKind.GRAMMAR, "start: foo"), 'constraint.grammar: at 1(8): unknown name: "foo"'),
        (Constraint(ConstraintKind.GRAMMAR, "root ::= foo", syntax="ebnf"), "constraint.grammar: not a valid GBNF grammar: Rule 'foo' not found"),
        (Constraint(ConstraintKind.GRAMMAR, 'root = "a"', syntax="ebnf"), "constraint.grammar: not a valid GBNF grammar: Expected ::= at line 1"),
    ],
)
def test_an_invalid_constraint_names_its_field_with_the_reason(backend, constraint, message):
    with pytest.raises(InvalidRequestError) as raised:
        backend.compile(constraint)
    assert raised.value.field == constraint.field
    assert str(raised.value).startswith(message)


def test_an_empty_choice_is_refused_where_the_constraint_is_made():
    with pytest.raises(InvalidRequestError) as raised:
        Constraint(ConstraintKind.CHOICE, choices=())
    assert raised.value.field == "constraint.choice"


def test_compiles_are_cached_by_constraint(tokenizer):
    backend = GrammarBackend(tokenizer, 49152, cache_size=2)
    schema = Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "integer"}')
    first = backend.compile(schema)
    assert backend.compile(Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "integer"}')) is first
    backend.matcher(schema)
    stats = backend.stats()
    assert (stats.num_compiles, stats.num_cache_hits, stats.num_compile_errors) == (1, 2, 0)
    assert stats.compile_s_total == first.compile_s > 0
    backend.compile(Constraint(ConstraintKind.REGEX, "a+"))
    backend.compile(Constraint(ConstraintKind.REGEX, "b+"))  # the cache holds 2: the schema goes
    assert backend.compile(schema) is not first
    assert backend.stats().num_compiles == 4


def test_a_refused_constraint_is_cached_too(tokenizer):
    backend = GrammarBackend(tokenizer, 49152)
    bad = Constraint(ConstraintKind.REGEX, "(")
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            backend.compile(bad)
    stats = backend.stats()
    assert (stats.num_compiles, stats.num_cache_hits, stats.num_compile_errors) == (1, 1, 1)


def test_a_compile_past_the_timeout_raises_and_finishes_later(tokenizer):
    release = threading.Event()

    def stuck_builder(constraint: Constraint) -> str:
        release.wait()
        return grammar_from_constraint(constraint)

    backend = GrammarBackend(tokenizer, 49152, compile_timeout_s=0.05, grammar_builder=stuck_builder)
    constraint = Constraint(ConstraintKind.REGEX, "[0-9]+")
    for _ in range(2):  # the second request waits on the same compile, and gives up the same way
        with pytest.raises(InvalidRequestError) as raised:
            backend.compile(constraint)
        assert str(raised.value) == "constraint.regex: did not compile within 0.05 s"
    release.set()
    assert backend.stats().num_compiles == 1 and backend.stats().num_compile_timeouts == 2
    backend = GrammarBackend(tokenizer, 49152, compile_timeout_s=10.0, grammar_builder=stuck_builder)
    assert backend.matcher(constraint).forced_tokens() == []


def test_any_json_object_and_the_layout_of_json(backend, tokenizer):
    matcher = backend.matcher(Constraint(ConstraintKind.JSON_OBJECT))
    for token_id in tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False):
        assert matcher.accept(token_id)
    assert matcher.is_finished
    matcher = backend.matcher(Constraint(ConstraintKind.JSON_OBJECT))
    assert not matcher.accept(tokenizer.encode("[", add_special_tokens=False)[0])
    assert matcher.accept(tokenizer.encode("{", add_special_tokens=False)[0])
    for text in (" ", "\n", "\t"):  # no whitespace where the layout has none
        assert not matcher.accept(tokenizer.encode(text, add_special_tokens=False)[0]), repr(text)


def test_the_schemas_own_whitespace_option_does_not_loosen_the_layout(backend, tokenizer):
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    matcher = backend.matcher(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
    assert matcher.accept(tokenizer.encode("{", add_special_tokens=False)[0])
    assert not matcher.accept(tokenizer.encode("\n", add_special_tokens=False)[0])


def test_logits_narrower_than_the_tokenizer_are_refused(tokenizer):
    with pytest.raises(ValueError, match="vocab_size 1000 is below the tokenizer's 49152 tokens"):
        GrammarBackend(tokenizer, 1000)


def test_concurrent_compiles_of_one_constraint_share_one_compile(tokenizer):
    release = threading.Event()
    num_builds = []

    def counting_builder(constraint: Constraint) -> str:
        num_builds.append(1)
        release.wait()
        return grammar_from_constraint(constraint)

    backend = GrammarBackend(tokenizer, 49152, grammar_builder=counting_builder)
    constraint = Constraint(ConstraintKind.JSON_OBJECT)
    results = []
    threads = [threading.Thread(target=lambda: results.append(backend.compile(constraint))) for _ in range(4)]
    for thread in threads:
        thread.start()
    release.set()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(compiled is results[0] for compiled in results)
    assert len(num_builds) == 1
    assert (backend.stats().num_compiles, backend.stats().num_cache_hits) == (1, 3)


def test_naming_a_matcher_loads_no_torch():
    """engine.request names GrammarMatcher, and the worker actor modules import engine.request
    without torch (tests/unit/test_layering.py)."""
    code = "import sys, engine.structured.backend, engine.structured.matcher; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[4], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
