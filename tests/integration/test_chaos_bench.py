"""bench.chaos on the tiny model: a real cluster (2 prefill + 2 decode, 2 routers, Redis tier)
under load while each fault runs once, the controller's and a router's SIGKILL included; nothing
lost, wrong, duplicated or leaked, and every fault recovered from. ``--duration-s 8`` spaces the
faults 1 s apart; each waits for the one before to recover, so the soak runs longer. Only
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
    argv = ["--duration-s", "8", "--model", str(tiny_llama_dir), "--kv-dtype", "fp32", "--phases", "soak", "--json", str(out)]
    code = run("chaos", chaos.main, argv)
    assert code == 0, capsys.readouterr().err[-3000:]
    report = json.loads(out.read_text())
    assert report["completed"] > 0
    assert {k: report[k] for k in ("lost", "wrong", "duplicated_tokens", "failed_unasked", "leaked_blocks", "open_leases", "open_handles")} == dict.fromkeys(
        ("lost", "wrong", "duplicated_tokens", "failed_unasked", "leaked_blocks", "open_leases", "open_handles"), 0)
    assert set(report["failed_with_status"]) <= {"CANCELLED", "DEADLINE_EXCEEDED"}
    assert all(report["faults"][kind] == 1 for kind in FAULTS) and report["faults"]["cancel"] > 0 and report["faults"]["deadline"] > 0
    assert all(f["recovered_s"] is not None for f in report["fault_log"])
    assert [f["kind"] for f in report["fault_log"]] == list(FAULTS)
    # The replica kills come after the controller's: its restart (generation+1) healed both pools.
    assert report["controller_restarts"] == 1
    assert report["pools"]["prefill"]["restarts"] >= 1 and report["pools"]["decode"]["restarts"] >= 1
    assert report["fault_log"][FAULTS.index("kill_router")]["target"] in {"router-0", "router-1"}
    by_fault = report["by_fault"]
    assert all(by_fault[kind]["count"] == 1 and by_fault[kind]["recovered_s_max"] is not None for kind in FAULTS)
    assert all(by_fault[kind]["max_gap_s"] is not None for kind in FAULTS), by_fault  # the load ran through every fault
    assert report["survived"] is True
