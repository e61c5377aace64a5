"""Each kind of ``Constraint`` as an llguidance grammar (text that ``llguidance.LLMatcher`` takes).

JSON (JSON_OBJECT and JSON_SCHEMA) is strict about layout: no optional whitespace, the
separators ``", "`` and ``": "`` (what ``json.dumps`` writes), whatever the schema's own
``x-guidance`` options say. A model cannot pad its answer with newlines until ``max_tokens``
runs out, the text is one exact string per value, and llguidance can force (jump forward) the
whole run between two values, e.g. ``", "age": `` after a string.

REGEX is the Rust ``regex`` crate's syntax (no look-around, no back-references), matched against
the whole answer; GRAMMAR's "ebnf" is llama.cpp's GBNF, converted to Lark by llguidance.
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from engine.errors import InvalidRequestError
from engine.params import Constraint, ConstraintKind

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON compile options, applied over the schema's own ``x-guidance``."""

ANY_JSON_OBJECT_SCHEMA = '{"type": "object"}'


def grammar_from_constraint(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``, not yet checked against the library.

    ``InvalidRequestError`` naming ``constraint.field`` for what can be refused before
    llguidance sees it: a JSON schema that is not JSON (or not an object, or false), or a GBNF
    grammar the converter cannot read. Everything else is checked when the matcher is built.
    """
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT_SCHEMA, overrides=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(_schema_object(constraint), overrides=JSON_OPTIONS)
    if kind is ConstraintKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if kind is ConstraintKind.CHOICE:
        # A Lark string literal takes JSON's escapes; ensure_ascii=False keeps characters outside
        # the BMP whole instead of writing them as surrogate pairs.
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in constraint.choices)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if kind is ConstraintKind.GRAMMAR:
        lark = constraint.spec if constraint.syntax == "lark" else _lark_from_gbnf(constraint)
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise AssertionError(f"unhandled constraint kind {kind}")


def _schema_object(constraint: Constraint) -> dict:
    try:
        schema = json.loads(constraint.spec)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(constraint.field, f"not valid JSON: {e}") from None
    if schema is True:
        return {}
    if schema is False:
        raise InvalidRequestError(constraint.field, "the schema false allows no value")
    if not isinstance(schema, dict):
        raise InvalidRequestError(constraint.field, f"a JSON Schema is an object or a boolean, got {type(schema).__name__}")
    return schema


def _lark_from_gbnf(constraint: Constraint) -> str:
    # The converter raises a bare Exception for some mistakes ("Rule 'foo' not found"), so every
    # exception here is the user's grammar; its message is the reason.
    try:
        return gbnf_to_lark(constraint.spec)
    except Exception as e:  # noqa: BLE001
        raise InvalidRequestError(constraint.field, f"not a valid GBNF grammar: {e}") from None
