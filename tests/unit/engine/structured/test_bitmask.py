"""Bitmasks: applying them to logits, filling many rows at once, and checking speculative drafts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from engine.params import Constraint, ConstraintKind
from engine.structured.bitmask import allocate_bitmask, apply_bitmask, fill_bitmasks
from engine.structured.verify import verify_drafts
from tests.unit.engine.structured.helpers import EOS, accept_text, allowed_ids, mask_of


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]) if rows is None else rows:
        for t in range(logits.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = -math.inf
    return out


@pytest.mark.parametrize(("vocab_size", "num_words"), [(100, 4), (96, 3), (130, 4), (70, 3)])
@pytest.mark.parametrize("rows", [None, [0, 2], [3]])
def test_apply_bitmask_matches_a_reference_loop(vocab_size, num_words, rows):
    # 100 logits over 4 words: padding bits past the logits; 130 over 4: logits past the bits
    generator = torch.Generator().manual_seed(vocab_size * 10 + num_words)
    logits = torch.randn(4, vocab_size, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, num_words), dtype=torch.int32, generator=generator)
    expected = reference_apply(logits, bitmask, rows)
    apply_bitmask(logits, bitmask, rows)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_allocate_bitmask_allows_everything():
    bitmask = allocate_bitmask(3, 49152 + 1)
    assert bitmask.shape == (3, 1537) and bitmask.dtype == torch.int32
    logits = torch.zeros(3, 49152 + 1)
    apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits).all()


def test_fill_bitmasks_fills_each_row_as_the_matcher_alone_would(backend, tokenizer):
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    prefixes = [
        (Constraint(ConstraintKind.JSON_SCHEMA, schema), '{"n": 1'),
        (Constraint(ConstraintKind.JSON_OBJECT), '{"k": "v'),
        (Constraint(ConstraintKind.REGEX, "[ab]+c"), "ab"),
        (Constraint(ConstraintKind.CHOICE, choices=("yes", "no")), "yes"),
    ]
    matchers = []
    for constraint, prefix in prefixes:
        matcher = backend.matcher(constraint)
        accept_text(matcher, tokenizer, prefix)
        matchers.append(matcher)
    bitmask = allocate_bitmask(6, 49152)
    bitmask.zero_()
    fill_bitmasks([(matcher, row) for matcher, row in zip(matchers, (5, 0, 3, 1))], bitmask)
    for matcher, row in zip(matchers, (5, 0, 3, 1)):
        np.testing.assert_array_equal(allowed_ids(bitmask[row]), mask_of(matcher))
    assert allowed_ids(bitmask[1]).tolist() == [EOS]
    assert bitmask[2].eq(0).all() and bitmask[4].eq(0).all()


def test_a_bitmask_of_the_wrong_width_is_refused(backend):
    matcher = backend.matcher(Constraint(ConstraintKind.JSON_OBJECT))
    with pytest.raises(ValueError, match="a bitmask row has 1536 words for this vocabulary, got 1535"):
        matcher.fill_bitmask(allocate_bitmask(1, 49120), 0)
    with pytest.raises(ValueError, match="contiguous 2-D int32 CPU tensor"):
        matcher.fill_bitmask(torch.zeros(1, 1536, dtype=torch.int64), 0)


def test_verify_drafts_masks_each_position_and_restores_the_matcher(backend, tokenizer):
    matcher = backend.matcher(Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]{2}"))
    accept_text(matcher, tokenizer, "1")
    start_mask = mask_of(matcher)
    drafts = tokenizer.encode("23-x", add_special_tokens=False)
    bitmask = allocate_bitmask(len(drafts) + 2, 49152)
    bitmask.zero_()
    assert verify_drafts(matcher, drafts, bitmask, first_row=1) == len(drafts)
    assert matcher.num_accepted_tokens == 1
    np.testing.assert_array_equal(mask_of(matcher), start_mask)
    np.testing.assert_array_equal(allowed_ids(bitmask[1]), start_mask)
    for i, token_id in enumerate(drafts):  # row 1 + i + 1: the mask after drafts 0..i
        assert matcher.accept(token_id)
        np.testing.assert_array_equal(allowed_ids(bitmask[1 + i + 1]), mask_of(matcher))
    assert bitmask[0].eq(0).all()


def test_verify_drafts_stops_at_the_first_refused_draft(backend, tokenizer):
    matcher = backend.matcher(Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[a-z]{2}"))
    drafts = tokenizer.encode("12a-xy", add_special_tokens=False)
    bitmask = allocate_bitmask(len(drafts) + 1, 49152)
    bitmask.zero_()
    num_accepted = verify_drafts(matcher, drafts, bitmask, first_row=0)
    assert tokenizer.decode(drafts[:num_accepted]) == "12"
    assert matcher.num_accepted_tokens == 0
    accept_text(matcher, tokenizer, "12")
    np.testing.assert_array_equal(allowed_ids(bitmask[num_accepted]), mask_of(matcher))
    assert bitmask[num_accepted + 1 :].eq(-1).all()  # never sampled from: every token allowed


def test_verify_drafts_past_the_end_accepts_only_eos(backend, tokenizer):
    matcher = backend.matcher(Constraint(ConstraintKind.CHOICE, choices=("yes", "no")))
    yes = tokenizer.encode("yes", add_special_tokens=False)
    bitmask = allocate_bitmask(4, 49152)
    assert verify_drafts(matcher, [*yes, EOS, EOS], bitmask, first_row=0) == 3
    assert verify_drafts(matcher, [*yes, yes[0]], bitmask, first_row=0) == 1
    assert allowed_ids(bitmask[1]).tolist() == [EOS]
    assert matcher.num_accepted_tokens == 0 and not matcher.is_finished
