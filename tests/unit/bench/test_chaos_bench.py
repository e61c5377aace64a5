"""bench.chaos's accounting, on hand-built outcomes (no cluster): what counts as wrong, lost,
duplicated or asked-for, the longest gap a stream saw in each fault's window, the summary by
fault kind; and its refusal of a model it cannot load."""

from __future__ import annotations

import subprocess
import sys

from bench.chaos import FAULTS, Outcome, tally
from bench.chaos_faults import baseline_gap, by_kind, window_stats

REFERENCES = [[1, 2, 3, 4], [5, 6, 7, 8]]
FAULT_LOG = [{"kind": kind, "at_s": 10.0 * (i + 1), "target": "x", "recovered_s": 1.0} for i, kind in enumerate(FAULTS)]


def _done(prompt: int, tokens: list[int], started_s: float = 0.0, ttft_s: float = 0.1, kind: str = "plain") -> Outcome:
    return Outcome(kind, prompt, started_s, "OK", ttft_s, tokens, len(tokens), finished=True)


def test_completed_calls_are_checked_against_their_prompts_reference():
    outcomes = [
        _done(0, [1, 2, 3, 4]),
        _done(1, [5, 6, 7, 8]),
        _done(1, [5, 6, 9, 8]),  # wrong from token 2
        _done(0, [1, 2, 2, 3, 4]),  # a token repeated across a migration
    ]
    counts = tally(outcomes, REFERENCES, FAULT_LOG)
    assert (counts["requests"], counts["completed"], counts["wrong"], counts["duplicated_tokens"]) == (4, 4, 2, 1)
    assert [(w["prompt"], w["diverged_at"]) for w in counts["wrong_examples"]] == [(1, 2), (0, 2)]


def test_a_status_counts_as_asked_for_only_where_a_cancel_or_deadline_asked_for_it():
    outcomes = [
        Outcome("cancel", 0, 0.0, "CANCELLED"),
        Outcome("deadline", 0, 0.0, "DEADLINE_EXCEEDED"),
        Outcome("plain", 0, 0.0, "UNAVAILABLE"),
        Outcome("cancel", 0, 0.0, "DEADLINE_EXCEEDED"),
        Outcome("plain", 1, 0.0, "OK", 0.1, [5, 6], 2, finished=False),  # the stream ended without a finish: lost
    ]
    counts = tally(outcomes, REFERENCES, FAULT_LOG)
    assert counts["failed_with_status"] == {"CANCELLED": 1, "DEADLINE_EXCEEDED": 2, "UNAVAILABLE": 1}
    assert (counts["failed_unasked"], counts["lost"], counts["completed"]) == (2, 1, 0)
    assert counts["faults"] == {**{kind: 1 for kind in FAULTS}, "cancel": 2, "deadline": 1}


def test_ttft_during_faults_takes_only_calls_started_in_a_window_after_a_fault():
    outcomes = [_done(0, [1, 2, 3, 4], started_s=s, ttft_s=t) for s, t in ((5.0, 9.0), (12.0, 2.0), (26.0, 3.0), (70.0, 7.0))]
    counts = tally(outcomes, REFERENCES, FAULT_LOG, window_s=5.0)
    assert counts["ttft_s_p99_during_faults"] == 2.0  # 12 s is 2 s after the first fault; 26 s is 6 s after the second
    unrecovered = [{**FAULT_LOG[0], "recovered_s": None}, *FAULT_LOG[1:]]
    assert tally(outcomes, REFERENCES, unrecovered)["unrecovered_faults"] == 1


def test_a_model_it_cannot_load_is_refused_with_one_sentence():
    result = subprocess.run([sys.executable, "-m", "bench.chaos", "--model", "/nonexistent", "--duration-s", "1"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("bench.chaos: --model /nonexistent: model '/nonexistent' is neither")


def _answered(*times: float, resumed_at: tuple[float, ...] = ()) -> Outcome:
    return Outcome("plain", 0, times[0], "OK", 0.1, [], 0, finished=True, times=list(times), resumed_at=list(resumed_at))


def test_a_faults_gap_is_the_longest_between_two_responses_that_ended_in_its_window():
    calls = [
        _answered(1.0, 1.5, 4.0, 4.2, resumed_at=(4.0,)),  # 2.5 s ending after the first fault's start; 0.5 s before it
        _answered(10.0, 10.1, 11.0, 13.0),  # 2.0 s ending in the second window: not the first's
        _answered(14.0, 17.5, 17.6, resumed_at=(17.5,)),  # 3.5 s in the second window, resumed on another router
        _answered(5.0),  # one response: no interval
    ]
    log = [{"kind": "kill_router", "at_s": 3.0, "recovered_s": 2.0}, {"kind": "kill_controller", "at_s": 12.0, "recovered_s": None}]
    assert window_stats(calls, log) == [{"max_gap_s": 2.5, "resumed_calls": 1}, {"max_gap_s": 3.5, "resumed_calls": 1}]
    assert window_stats(calls[1:2], log) == [{"max_gap_s": 0.9, "resumed_calls": 0}, {"max_gap_s": 2.0, "resumed_calls": 0}]
    assert window_stats([_answered(5.0)], log[:1]) == [{"max_gap_s": None, "resumed_calls": 0}]
    assert baseline_gap(calls, before_s=3.0) == 0.5


def test_faults_are_summed_up_by_kind_with_their_recoveries_and_longest_gap():
    log = [
        {"kind": "kill_router", "at_s": 3.0, "recovered_s": 2.0, "max_gap_s": 1.25, "resumed_calls": 2},
        {"kind": "kill_router", "at_s": 9.0, "recovered_s": 4.5, "max_gap_s": 0.75, "resumed_calls": 1},
        {"kind": "kill_controller", "at_s": 12.0, "recovered_s": None, "max_gap_s": None, "resumed_calls": 0},
    ]
    summary = by_kind(log, baseline_gap_s=0.2)
    assert summary["kill_router"] == {"count": 2, "recovered_s": [2.0, 4.5], "recovered_s_max": 4.5, "max_gap_s": 1.25, "resumed_calls": 3}
    assert summary["kill_controller"] == {"count": 1, "recovered_s": [None], "recovered_s_max": None, "max_gap_s": None, "resumed_calls": 0}
    assert summary["drop_transfer"] == {"count": 0, "recovered_s": [], "recovered_s_max": None, "max_gap_s": None, "resumed_calls": 0}
    assert summary["before_faults"] == {"max_gap_s": 0.2}
    assert set(summary) == {*FAULTS, "before_faults"}
