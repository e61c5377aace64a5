"""bench.chaos's accounting, on hand-built outcomes (no cluster): what counts as wrong, lost,
duplicated or asked-for; and its refusal of a model it cannot load."""

from __future__ import annotations

import subprocess
import sys

from bench.chaos import FAULTS, Outcome, tally

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
