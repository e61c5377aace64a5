"""One constraint kind and its value -> ``splitserve.v1.Constraint``: the checks every front end shares.

Each API spells and nests the fields its own way (OpenAI's ``structured_outputs.regex``, KServe's
``parameters.regex``) and decides which kind was asked for; from a kind, a value and where the
value came from (for the refusal), the checks and their messages are the same everywhere. A schema
may come as an object or as its JSON text (KServe's parameters are scalars).
"""

from __future__ import annotations

import json

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import invalid

GRAMMAR_SYNTAXES = ("lark", "ebnf")


def fill_constraint(constraint: pb.Constraint, kind: str, value: object, where: str, syntax: tuple[object, str] | None = None) -> None:
    """Set ``kind`` (json_schema, choice, regex or grammar) to ``value`` on ``constraint``, refusing
    a bad value as INVALID_ARGUMENT at ``where``; ``syntax`` is a grammar's (syntax, where), lark
    when not given."""
    if kind == "json_schema":
        schema = parse_json(where, value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise invalid(where, f"must be a JSON Schema object (or its JSON text), got {type(schema).__name__}")
        constraint.json_schema = json.dumps(schema, ensure_ascii=False)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid(where, "must be a non-empty array of non-empty strings")
        constraint.choice.choices.extend(value)
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise invalid(where, "must be a non-empty string")
        if kind == "regex":
            constraint.regex = value
            return
        name, name_where = syntax or ("lark", where)
        if name not in GRAMMAR_SYNTAXES:
            raise invalid(name_where, f"must be {' or '.join(GRAMMAR_SYNTAXES)}, got {name!r}")
        constraint.grammar.source = value
        constraint.grammar.syntax = name
    else:
        raise AssertionError(f"no constraint kind {kind!r}")


def parse_json(where: str, text: str) -> object:
    """``text`` parsed, or INVALID_ARGUMENT at ``where`` saying why it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(where, f"not valid JSON ({e})") from e
