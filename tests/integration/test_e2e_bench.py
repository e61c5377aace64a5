"""bench.e2e end to end on real clusters (aggregated, then 1 prefill + 1 decode over NIXL) with a
tiny model: the report's structure and invariants, the plot, the progress lines. No speed."""

from __future__ import annotations

import json

import pytest

from bench import e2e
from bench.e2e import SERVING_PATH, STAGES
from bench.report import run
from engine.config import EngineConfig
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_REQUESTS, OUTPUT_LEN, STREAMS, STREAM_LEN = 3, 6, 2, 8


def test_a_small_run_reports_every_layout_with_stages_that_add_up(ray_session, tiny_llama_dir, tmp_path, capsys):
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    argv = [
        "--model", str(tiny_llama_dir), "--pools", "0:1", "1:1", "--concurrency", "2", "--rounds", "1",
        "--num-requests", str(NUM_REQUESTS), "--prompt-len", "20", "40", "--output-len", str(OUTPUT_LEN), str(OUTPUT_LEN),
        "--decode-streams", str(STREAMS), "--decode-output-len", str(STREAM_LEN), "--prefill-prompt-len", "64",
        "--kv-dtype", "fp32", "--kv-cache-mib", "16", "--json", str(out), "--plot", str(png),
    ]  # fmt: skip
    assert e2e.main(argv) == 0
    report = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["machine"]["cpus"] >= 1 and report["machine"]["date"]

    rows = {(r["pools"], r["system"]): r for r in report["runs"]}
    assert set(rows) == {("0:1", "engine"), ("0:1", "grpc"), ("1:1", "engine"), ("1:1", "grpc")}
    for row in rows.values():
        assert row["num_requests"] == NUM_REQUESTS and row["num_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
        assert sum(row["stage_ms_mean"].values()) == pytest.approx(row["ttft_ms_mean"], abs=0.01 * len(STAGES))
        assert all(v >= 0 for v in row["stage_ms_mean"].values())  # each stage is a slice of the TTFT
    # In-process there is no serving path; aggregated there is no hand-off; disaggregated there is.
    assert not set(SERVING_PATH) & set(rows["0:1", "engine"]["stage_ms_mean"])
    assert "kv_handoff" not in rows["0:1", "grpc"]["stage_ms_mean"]
    assert rows["1:1", "grpc"]["stage_ms_mean"]["kv_handoff"] > 0 and "wait" not in rows["1:1", "grpc"]["stage_ms_mean"]
    assert rows["1:1", "grpc"]["stage_ms_mean"]["prefill"] == pytest.approx(0, abs=0.05)  # the prefill worker computed it
    assert {v["pools"] for v in report["grpc_vs_engine"]} == {"0:1", "1:1"}

    assert [i["pools"] for i in report["interference"]] == ["0:1", "1:1"]
    for layout in report["interference"]:
        assert layout["quiet"]["prompts_prefilled"] == 0 and layout["with_prefill"]["prompts_prefilled"] >= 1
        assert layout["quiet"]["decode_s"] > 0 and layout["with_prefill"]["decode_s"] > 0
        assert layout["quiet"]["itl_ms_p50"] <= layout["quiet"]["itl_ms_p99"]

    err = capsys.readouterr().err
    for line in ("loading", "starting a cluster: 1 prefill, 1 decode", "sweep 0:1 N=2 round 1/1 grpc", "interference 1:1 with_prefill"):
        assert line in err


def test_address_measures_a_running_cluster_and_refuses_another_model(ray_session, tiny_llama_dir, tmp_path, capsys):
    engine = EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=256)
    with running_cluster(ClusterConfig(engine=engine, router=RouterConfig(port=0))) as cluster:
        address = cluster.router_status.grpc_address
        out = tmp_path / "e2e.json"
        argv = ["--address", address, "--phases", "sweep", "--concurrency", "1", "--rounds", "1", "--num-requests", "2",
                "--prompt-len", "20", "20", "--output-len", "4", "4", "--prefill-prompt-len", "64", "--kv-dtype", "fp32", "--kv-cache-mib", "16",
                "--json", str(out)]
        assert e2e.main(["--model", str(tiny_llama_dir), *argv]) == 0
        report = json.loads(out.read_text())
        assert report["address"] == address and report["interference"] == []
        assert {(r["pools"], r["system"]) for r in report["runs"]} == {("0:1", "engine"), ("0:1", "grpc")}
        assert all(r["num_output_tokens"] == 2 * 4 for r in report["runs"])
        assert "starting a cluster" not in capsys.readouterr().err

        assert run("e2e", e2e.main, ["--model", "smollm2-135m", *argv]) == 2
        assert capsys.readouterr().err.strip().endswith(f"the router at {address} serves {tiny_llama_dir.name}, not --model smollm2-135m")
