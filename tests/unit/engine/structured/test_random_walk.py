"""Constrained random walks: sample uniformly among the tokens the mask allows until the matcher
is finished (or EOS is drawn where the answer is whole), then check the text with a parser that
knows nothing of llguidance. 20 seeds per kind."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np

from engine.params import Constraint, ConstraintKind
from engine.structured.matcher import GrammarMatcher
from engine.tokenizer import Tokenizer
from tests.unit.engine.structured.helpers import EOS, mask_of

MAX_TOKENS = 200
SEEDS = range(20)
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ("red", "green", "dark blue", "ünï 😀")
LARK = 'start: "[" NUM ("," NUM){0,4} "]"\nNUM: /-?[0-9]{1,3}/\n'
GBNF = 'root ::= "(" num (" + " num){0,3} ")"\nnum ::= [0-9]{1,3}\n'


def walk(matcher: GrammarMatcher, rng: random.Random, closing_ids: np.ndarray | None = None) -> list[int] | None:
    """The tokens of one walk; None when it ran past MAX_TOKENS. With ``closing_ids``, every other
    step draws among the allowed tokens in it (when there are any), so an open-ended grammar ends."""
    token_ids: list[int] = []
    while not matcher.is_finished and len(token_ids) < MAX_TOKENS:
        allowed = mask_of(matcher)
        if closing_ids is not None and rng.random() < 0.5 and len(closing := np.intersect1d(allowed, closing_ids)):
            allowed = closing
        token_id = int(allowed[rng.randrange(len(allowed))])
        if token_id == EOS:
            assert matcher.is_accepting
            return token_ids
        assert matcher.accept(token_id)
        token_ids.append(token_id)
    return token_ids if matcher.is_finished else None


def walks(backend, tokenizer: Tokenizer, constraint: Constraint, closing_ids: np.ndarray | None = None) -> list[str]:
    texts = []
    for seed in SEEDS:
        token_ids = walk(backend.matcher(constraint), random.Random(seed), closing_ids)
        assert token_ids is not None, f"seed {seed} did not finish in {MAX_TOKENS} tokens"
        texts.append(tokenizer.decode(token_ids))
    return texts


def test_json_schema(backend, tokenizer):
    for text in walks(backend, tokenizer, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(RECORD))):
        jsonschema.validate(json.loads(text), RECORD)
        assert json.dumps(json.loads(text), ensure_ascii=False) == text  # the layout is json.dumps's


def test_json_object(backend, tokenizer):
    closing_ids = np.array([t for t in range(tokenizer.vocab_size) if any(c in tokenizer.decode([t]) for c in '"}]')])
    for text in walks(backend, tokenizer, Constraint(ConstraintKind.JSON_OBJECT), closing_ids):
        assert isinstance(json.loads(text), dict), text


def test_regex(backend, tokenizer):
    for text in walks(backend, tokenizer, Constraint(ConstraintKind.REGEX, EMAIL)):
        assert re.fullmatch(EMAIL, text), text


def test_choice(backend, tokenizer):
    texts = walks(backend, tokenizer, Constraint(ConstraintKind.CHOICE, choices=CHOICES))
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1


def test_lark_grammar(backend, tokenizer):
    for text in walks(backend, tokenizer, Constraint(ConstraintKind.GRAMMAR, LARK)):
        assert re.fullmatch(r"\[-?[0-9]{1,3}(,-?[0-9]{1,3}){0,4}\]", text), text


def test_gbnf_grammar(backend, tokenizer):
    for text in walks(backend, tokenizer, Constraint(ConstraintKind.GRAMMAR, GBNF, syntax="ebnf")):
        assert re.fullmatch(r"\([0-9]{1,3}( \+ [0-9]{1,3}){0,3}\)", text), text
