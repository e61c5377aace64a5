"""bench.chaos on the tiny model: a real cluster (2 prefill + 2 decode, Redis tier) under load
while each fault runs once; nothing lost, wrong, duplicated or leaked. ``--duration-s 15`` spaces
the faults 3 s apart; each waits for the one before to recover, so the soak runs longer. Only
the soak: the bench's pauses phase times what tests/integration/test_failover.py already asserts
(a stream continuing when its decode replica is killed, frozen or the only one)."""

from __future__ import annotations

import json

import pytest

from bench import chaos
from bench.chaos import FAULTS
from bench.report import run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_soak_with_each_fault_once_loses_nothing(ray_session, tiny_llama_dir, tmp_path, capsys):
    """In this process, on the session's Ray: the cluster's replicas are Ray actors either way."""
    out = tmp_path / "chaos.json"
    argv = ["--duration-s", "15", "--model", str(tiny_llama_dir), "--kv-dtype", "fp32", "--phases", "soak", "--json", str(out)]
    code = run("chaos", chaos.main, argv)
    assert code == 0, capsys.readouterr().err[-3000:]
    report = json.loads(out.read_text())
    assert report["completed"] > 0
    assert {k: report[k] for k in ("lost", "wrong", "duplicated_tokens", "failed_unasked", "leaked_blocks", "open_leases", "open_handles")} == dict.fromkeys(
        ("lost", "wrong", "duplicated_tokens", "failed_unasked", "leaked_blocks", "open_leases", "open_handles"), 0)
    assert set(report["failed_with_status"]) <= {"CANCELLED", "DEADLINE_EXCEEDED"}
    assert all(report["faults"][kind] == 1 for kind in FAULTS) and report["faults"]["cancel"] > 0 and report["faults"]["deadline"] > 0
    assert all(f["recovered_s"] is not None for f in report["fault_log"])
    assert report["pools"]["prefill"]["restarts"] >= 1 and report["pools"]["decode"]["restarts"] >= 1
    assert report["survived"] is True
