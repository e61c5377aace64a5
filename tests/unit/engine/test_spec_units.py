"""Speculative decoding's pure parts: n-gram lookup, acceptance, the cost policy, config checks."""

import pytest

from engine.config import EngineConfig
from engine.spec.ngram import propose_ngram
from engine.spec.policy import AcceptanceTracker, SpecPolicy
from engine.spec.verify import accepted_prefix


def test_ngram_copies_what_followed_the_longest_matching_tail():
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 8, 6, 7]
    # tail (8, 6, 7) never occurred before; (6, 7) did, latest at 6..7, followed by 8 6 7
    assert propose_ngram(tokens, 3, min_match=2, max_match=3) == [8, 6, 7]
    assert propose_ngram(tokens, 1, min_match=2, max_match=3) == [8]


def test_ngram_prefers_longer_matches_and_the_latest_occurrence():
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    assert propose_ngram(tokens, 2, min_match=2, max_match=3) == [40, 9]  # (1, 2, 3) beats the later (2, 3)
    assert propose_ngram(tokens, 2, min_match=2, max_match=2) == [50, 1]  # (2, 3): the latest one


def test_ngram_proposes_nothing_without_a_match_or_room():
    assert propose_ngram([1, 2, 3, 4], 3, min_match=1, max_match=3) == []
    assert propose_ngram([7], 3, min_match=1, max_match=3) == []
    assert propose_ngram([1, 2, 1, 2], 0, min_match=1, max_match=3) == []
    assert propose_ngram([4, 4, 4], 5, min_match=1, max_match=1) == [4]  # the continuation ends at the sequence's end


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix((4, 5, 6), (4, 5, 6, 9)) == 3
    assert accepted_prefix((4, 5, 6), (4, 7, 6, 9)) == 1
    assert accepted_prefix((4,), (3, 1)) == 0
    with pytest.raises(ValueError, match="3 drafts need 4 samples, got 3"):
        accepted_prefix((4, 5, 6), (4, 5, 6))


def test_policy_keeps_drafting_while_drafts_are_accepted():
    policy, tracker = SpecPolicy(token_cost=0.1), AcceptanceTracker()
    verified = []
    for _ in range(20):
        k = policy.num_to_verify(tracker, 4)
        verified.append(k)
        tracker.observe(k, k)
    assert verified[0] == 2  # a new sequence's prior (half accepted) pays best at two drafts
    assert verified[3:] == [4] * 17
    assert tracker.rate > 0.9


def test_policy_backs_off_when_drafts_are_rejected_and_probes_again():
    policy, tracker = SpecPolicy(token_cost=0.1, first_backoff=8, max_backoff=16), AcceptanceTracker()
    verified = []
    for _ in range(80):
        k = policy.num_to_verify(tracker, 4)
        verified.append(k)
        if k:
            tracker.observe(k, 0)
    # a few rejected verify steps; the step deciding to stop and a back-off of 8; a probe of one
    # draft; rejected, the deciding step and 16 more; a probe ...
    first_off = verified.index(0)
    assert 1 <= first_off <= 5
    assert verified[first_off:] == ([0] * 9 + [1] + ([0] * 17 + [1]) * 4)[: 80 - first_off]


def test_policy_asks_more_of_drafts_in_a_larger_batch():
    """A batch of 8 already shares each step's weight reads: drafts accepted 44% (or 86%) of the
    time pay alone, not there; drafts accepted 98% of the time pay in both."""
    policy = SpecPolicy(token_cost=0.2, chunk_cost=0.16)
    for rate in (0.44, 0.86):
        assert policy.num_to_verify(AcceptanceTracker(accepted=rate, trials=1.0), 4, batch_size=1) >= 1
        assert policy.num_to_verify(AcceptanceTracker(accepted=rate, trials=1.0), 4, batch_size=8) == 0
    assert policy.num_to_verify(AcceptanceTracker(accepted=0.98, trials=1.0), 4, batch_size=8) == 4


def test_policy_refuses_drafts_that_cost_more_than_they_can_yield():
    assert SpecPolicy(token_cost=1.5).num_to_verify(AcceptanceTracker(accepted=0.99, trials=1.0), 4) == 0
    assert SpecPolicy(token_cost=0.1).num_to_verify(AcceptanceTracker(), 0) == 0


def test_config_refuses_speculation_on_more_than_one_rank():
    with pytest.raises(ValueError, match="speculative: 'ngram' runs on replicas of one rank only"):
        EngineConfig(speculative="ngram", tp_size=2)
    with pytest.raises(ValueError, match="ngram_min_match, ngram_max_match"):
        EngineConfig(speculative="ngram", ngram_min_match=3, ngram_max_match=2)


def test_draft_counters_are_exported():
    from prometheus_client import CollectorRegistry, generate_latest

    from engine.outputs import EngineStats
    from engine.metrics import EngineStatsCollector

    stats = EngineStats(0, 0, 8, 8, 0, 0, 0, 0, num_draft_tokens=40, num_accepted_draft_tokens=31)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, {"replica": "d0"}))
    text = generate_latest(registry).decode()
    assert 'splitserve_engine_spec_draft_tokens_total{replica="d0"} 40.0' in text
    assert 'splitserve_engine_spec_accepted_tokens_total{replica="d0"} 31.0' in text
