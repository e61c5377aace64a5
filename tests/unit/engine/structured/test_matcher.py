"""GrammarMatcher on the real SmolLM2 tokenizer: accept, masks, the end, rollback, forced tokens."""

from __future__ import annotations

import json
import random

import numpy as np

from engine.params import Constraint, ConstraintKind
from engine.structured.backend import GrammarBackend
from engine.structured.bitmask import allocate_bitmask
from tests.unit.engine.structured.helpers import EOS, accept_text, allowed_ids, mask_of

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_CONSTRAINT = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON))


def test_a_schema_accepts_a_valid_instance_and_finishes_on_its_last_token(backend, tokenizer):
    matcher = backend.matcher(PERSON_CONSTRAINT)
    token_ids = accept_text(matcher, tokenizer, '{"name": "Bob", "age": 42')
    assert not matcher.is_finished and not matcher.is_accepting
    assert matcher.accept(tokenizer.encode("}", add_special_tokens=False)[0])
    assert matcher.is_finished and matcher.is_accepting
    assert matcher.num_accepted_tokens == len(token_ids) + 1
    assert mask_of(matcher).tolist() == [EOS]


def test_a_refused_token_leaves_the_matcher_as_it_was(backend, tokenizer):
    matcher = backend.matcher(PERSON_CONSTRAINT)
    accept_text(matcher, tokenizer, '{"name": "Bob", "age": ')
    before = mask_of(matcher)
    for text in ('"', "x", "}", " "):  # a string, a letter, closing early, whitespace: none fits an integer here
        assert not matcher.accept(tokenizer.encode(text, add_special_tokens=False)[0]), text
    assert not matcher.accept(EOS)
    assert not matcher.accept(49152) and not matcher.accept(-1)
    np.testing.assert_array_equal(mask_of(matcher), before)
    accept_text(matcher, tokenizer, "7}")
    assert matcher.is_finished


def test_the_mask_allows_exactly_what_accept_accepts(backend, tokenizer):
    rng = random.Random(0)
    for constraint, prefix in (
        (PERSON_CONSTRAINT, '{"name": "Al'),
        (PERSON_CONSTRAINT, '{"name": "Al", "age": 1'),
        (Constraint(ConstraintKind.REGEX, r"[0-9]{2,4}-[a-z]+"), "12"),
        (Constraint(ConstraintKind.CHOICE, choices=("north", "south")), "n"),
    ):
        matcher = backend.matcher(constraint)
        accept_text(matcher, tokenizer, prefix)
        allowed = set(mask_of(matcher).tolist())
        sample = rng.sample(sorted(allowed), min(50, len(allowed))) + rng.sample(range(49152), 200)
        for token_id in sample:
            accepted = matcher.accept(token_id)
            assert accepted == (token_id in allowed), (prefix, token_id, tokenizer.decode([token_id]))
            if accepted:
                matcher.rollback(1)


def test_a_choice_allows_only_the_choices_continuations_and_finishes(backend, tokenizer):
    matcher = backend.matcher(Constraint(ConstraintKind.CHOICE, choices=("north", "south", "no")))
    first = {tokenizer.decode([t]) for t in mask_of(matcher)}
    assert first == {"n", "no", "nor", "north", "s", "so", "south"}  # every prefix SmolLM2 has as one token
    accept_text(matcher, tokenizer, "no")
    assert matcher.is_accepting and not matcher.is_finished  # "no" is whole, "north" goes on
    assert {tokenizer.decode([t], skip_special_tokens=False) for t in mask_of(matcher)} == {"r", "rt", "<|im_end|>"}
    accept_text(matcher, tokenizer, "rth")
    assert matcher.is_finished
    assert mask_of(matcher).tolist() == [EOS]


def test_choices_are_literal_strings(backend, tokenizer):
    choices = ('say "hi"', "back\\slash", "a|b", "/x/", "😀 ünï", "two\nlines")
    for choice in choices:
        matcher = backend.matcher(Constraint(ConstraintKind.CHOICE, choices=choices))
        accept_text(matcher, tokenizer, choice)
        assert matcher.is_finished, choice
    matcher = backend.matcher(Constraint(ConstraintKind.CHOICE, choices=choices))
    assert not matcher.accept(tokenizer.encode("ab", add_special_tokens=False)[0])


def test_a_regex_constrains_the_whole_answer(backend, tokenizer):
    matcher = backend.matcher(Constraint(ConstraintKind.REGEX, r"ab+"))
    assert [tokenizer.decode([t]) for t in mask_of(matcher)] == ["a", "ab"]
    accept_text(matcher, tokenizer, "ab")
    assert matcher.is_accepting and not matcher.is_finished
    assert EOS in mask_of(matcher)
    assert not matcher.accept(tokenizer.encode("a", add_special_tokens=False)[0])
    assert matcher.accept(EOS)  # sampling EOS where the regex is whole ends the answer
    assert matcher.is_finished and mask_of(matcher).tolist() == [EOS]


def test_a_lark_grammar(backend, tokenizer):
    grammar = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]+/\n'
    matcher = backend.matcher(Constraint(ConstraintKind.GRAMMAR, grammar))
    accept_text(matcher, tokenizer, "(1+(2*3)")
    assert not matcher.accept(tokenizer.encode("(", add_special_tokens=False)[0])
    accept_text(matcher, tokenizer, ")")
    assert matcher.is_finished


def test_a_gbnf_grammar(backend, tokenizer):
    grammar = 'root ::= answer "."\nanswer ::= "yes" | "no" | "maybe " [0-9]+\n'
    matcher = backend.matcher(Constraint(ConstraintKind.GRAMMAR, grammar, syntax="ebnf"))
    accept_text(matcher, tokenizer, "maybe 42")
    assert not matcher.accept(tokenizer.encode("!", add_special_tokens=False)[0])
    accept_text(matcher, tokenizer, ".")
    assert matcher.is_finished


def test_rollback_restores_the_state(backend, tokenizer):
    matcher = backend.matcher(PERSON_CONSTRAINT)
    accept_text(matcher, tokenizer, '{"name": "')
    before, num_before = mask_of(matcher), matcher.num_accepted_tokens
    num_more = len(accept_text(matcher, tokenizer, 'Ann", "age": 3}'))
    assert matcher.is_finished
    assert matcher.accept(EOS) and matcher.accept(EOS)  # EOS after the end counts as tokens too
    matcher.rollback(num_more + 2)
    assert matcher.num_accepted_tokens == num_before and not matcher.is_finished
    np.testing.assert_array_equal(mask_of(matcher), before)


def test_rollback_over_an_eos_sampled_while_accepting(backend, tokenizer):
    matcher = backend.matcher(Constraint(ConstraintKind.REGEX, r"ab+"))
    accept_text(matcher, tokenizer, "ab")
    before = mask_of(matcher)
    assert matcher.accept(EOS) and matcher.accept(EOS)
    matcher.rollback(2)
    assert not matcher.is_finished
    np.testing.assert_array_equal(mask_of(matcher), before)


def test_rolling_back_more_than_was_accepted_is_refused(backend, tokenizer):
    matcher = backend.matcher(PERSON_CONSTRAINT)
    accept_text(matcher, tokenizer, "{")
    try:
        matcher.rollback(2)
    except ValueError as e:
        assert str(e) == "cannot roll back 2 tokens: 1 accepted"
    else:
        raise AssertionError("rollback(2) after one token did not raise")


def test_forced_tokens_of_a_fixed_key_prefix(backend, tokenizer):
    matcher = backend.matcher(PERSON_CONSTRAINT)
    assert tokenizer.decode(matcher.forced_tokens()) == '{"name":'
    accept_text(matcher, tokenizer, '{"name": "Bob')
    assert matcher.forced_tokens() == []  # the string may go on
    accept_text(matcher, tokenizer, '"')
    forced = matcher.forced_tokens()
    assert tokenizer.decode(forced) == ', "age":'
    for token_id in forced:
        assert matcher.accept(token_id)
    assert matcher.forced_tokens() == []  # a number of any length
    accept_text(matcher, tokenizer, " 5}")
    assert matcher.is_finished and matcher.forced_tokens() == []


def test_a_fresh_matcher_does_not_share_state(backend, tokenizer):
    first = backend.matcher(PERSON_CONSTRAINT)
    accept_text(first, tokenizer, '{"name": "x", "age": 1}')
    second = backend.matcher(PERSON_CONSTRAINT)
    assert second.num_accepted_tokens == 0 and not second.is_finished
    assert tokenizer.decode(second.forced_tokens()) == '{"name":'


def test_tokens_past_the_tokenizer_are_never_allowed(backend, tokenizer):
    # SmolLM2's logits are as wide as its tokenizer; a wider head pads with ids nothing decodes to
    wide = GrammarBackend(tokenizer, 49152 + 40)
    matcher = wide.matcher(Constraint(ConstraintKind.JSON_OBJECT))
    bitmask = allocate_bitmask(1, 49152 + 40)
    assert bitmask.shape == (1, 1538)
    matcher.fill_bitmask(bitmask, 0)
    allowed = allowed_ids(bitmask[0])
    assert allowed.max() < 49152 and len(allowed) > 0
    assert not matcher.accept(49152 + 3)
