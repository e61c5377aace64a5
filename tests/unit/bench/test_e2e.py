"""bench.e2e's arithmetic and its refusals, on hand-built samples (no cluster, no model)."""

from __future__ import annotations

import pytest

from bench import e2e
from bench.e2e import SERVING_PATH, STAGES, Run, Sample, record, summarize, timings_stages, variant
from bench.report import run
from bench.workload import BenchRequest
from proto import splitserve_pb2 as pb
from tests.redis_server import free_port


def _timings(**fields) -> pb.Timings:
    return pb.Timings(**fields)


def test_a_grpc_requests_stages_add_up_to_its_ttft_with_a_handoff_only_when_prefilled_remotely():
    local = _timings(worker_first_token_s=0.200, request_plane_s=0.001, admitted_s=0.010, queue_s=0.030, first_step_end_s=0.190)
    stages = timings_stages(local, ttft_s=0.205)
    assert list(stages) == ["hops", "request_plane", "pickup", "wait", "prefill", "handback"]
    assert stages["hops"] == pytest.approx(0.004)
    assert stages["wait"] == pytest.approx(0.020) and stages["handback"] == pytest.approx(0.010)
    assert sum(stages.values()) == pytest.approx(0.205)

    remote = _timings(worker_first_token_s=0.300, request_plane_s=0.001, admitted_s=0.010, kv_handoff_s=0.250, queue_s=0.270, first_step_end_s=0.290)
    stages = timings_stages(remote, ttft_s=0.304)
    assert list(stages) == ["hops", "request_plane", "pickup", "kv_handoff", "prefill", "handback"]
    assert stages["kv_handoff"] == pytest.approx(0.260)  # parked until it joins the batch: no wait
    assert sum(stages.values()) == pytest.approx(0.304)


def test_record_spreads_a_multi_token_gap_over_its_tokens():
    sample = record(10.0, [(10.5, 1), (10.7, 1), (11.1, 2)], {"prefill": 0.5})
    assert sample.ttft_s == pytest.approx(0.5)
    assert sample.num_tokens == 4
    assert sample.itl_s == pytest.approx((0.2, 0.2, 0.2))


def test_variants_share_lengths_and_differ_in_the_first_token_only():
    workload = [BenchRequest((40, 41, 42), 5), BenchRequest((50, 51), 7)]
    a, b = variant(workload, 33), variant(workload, 34)
    assert [r.prompt_token_ids for r in a] == [(33, 41, 42), (33, 51)]
    assert [r.prompt_token_ids[1:] for r in b] == [r.prompt_token_ids[1:] for r in workload]
    assert [r.num_output_tokens for r in a] == [5, 7]


def _sample(ttft_s: float, stages: dict[str, float], num_tokens: int = 3) -> Sample:
    return Sample(ttft_s, (0.1,) * (num_tokens - 1), num_tokens, stages)


ENGINE = {"pickup": 0.01, "wait": 0.0, "prefill": 0.08, "handback": 0.01}
GRPC = {"hops": 0.004, "request_plane": 0.001, **ENGINE}
DISAGG = {"hops": 0.003, "request_plane": 0.001, "pickup": 0.01, "kv_handoff": 0.2, "prefill": 0.0, "handback": 0.006}


def test_summary_pools_rounds_and_reports_absent_stages_as_absent():
    runs = [
        Run("engine", "0:1", 2, 1.0, [_sample(0.10, ENGINE), _sample(0.10, ENGINE)]),
        Run("grpc", "0:1", 2, 1.5, [_sample(0.105, GRPC), _sample(0.105, GRPC)]),
        Run("engine", "0:1", 2, 1.0, [_sample(0.10, ENGINE)]),
        Run("grpc", "0:1", 2, 1.5, [_sample(0.105, GRPC)]),
        Run("engine", "1:1", 2, 1.0, [_sample(0.10, ENGINE)]),
        # One request prefilled remotely, one locally: the hand-off is there, averaged over both.
        Run("grpc", "1:1", 2, 2.0, [_sample(0.22, DISAGG), _sample(0.105, GRPC)]),
    ]
    report = summarize(runs)
    rows = {(r["pools"], r["system"]): r for r in report["runs"]}
    assert set(rows) == {("0:1", "engine"), ("0:1", "grpc"), ("1:1", "engine"), ("1:1", "grpc")}

    engine, grpc, disagg = rows["0:1", "engine"], rows["0:1", "grpc"], rows["1:1", "grpc"]
    assert (engine["rounds"], engine["num_requests"], engine["num_output_tokens"]) == (2, 3, 9)
    assert engine["output_tok_per_s"] == 4.5 and engine["output_tok_per_s_by_round"] == [6.0, 3.0]
    assert list(engine["stage_ms_mean"]) == ["pickup", "wait", "prefill", "handback"]
    assert list(grpc["stage_ms_mean"]) == ["hops", "request_plane", "pickup", "wait", "prefill", "handback"]
    assert list(disagg["stage_ms_mean"]) == list(STAGES)
    assert disagg["stage_ms_mean"]["kv_handoff"] == 100.0
    for row in report["runs"]:
        assert sum(row["stage_ms_mean"].values()) == pytest.approx(row["ttft_ms_mean"], abs=0.01 * len(STAGES))
        assert row["ttft_ms_p50"] <= row["ttft_ms_p90"] <= row["ttft_ms_p99"]
        assert row["itl_ms_p50"] == 100.0

    versus = {v["pools"]: v for v in report["grpc_vs_engine"]}
    assert versus["0:1"]["throughput_ratio"] == round((9 / 3.0) / 4.5, 3)
    assert versus["0:1"]["ttft_ms_p50_added"] == 5.0
    assert versus["0:1"]["serving_path_ms_mean"] == pytest.approx(sum(GRPC[s] for s in SERVING_PATH) * 1000)
    assert versus["1:1"]["serving_path_ms_mean"] == pytest.approx(4.5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pools", "1"], "is not PREFILL:DECODE"),
        (["--pools", "1:0"], "needs >= 0 prefill and >= 1 decode"),
        (["--concurrency", "0"], "is not a positive whole number"),
        (["--prompt-len", "64", "32"], "--prompt-len: MIN is above MAX"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_bad_options_exit_2_with_a_sentence(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_router_that_is_not_up_is_one_sentence_not_a_traceback(capsys):
    port = free_port()  # a loopback port nothing listens on
    assert run("e2e", e2e.main, ["--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"bench.e2e: no splitserve router answers at 127.0.0.1:{port} (UNAVAILABLE")


def test_an_unknown_model_is_one_sentence(capsys):
    assert run("e2e", e2e.main, ["--model", "no-such-model"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("bench.e2e: --model: model 'no-such-model' is neither a checkpoint directory nor a bundled model")
    assert not any("Traceback" in line for line in lines)


def test_a_request_longer_than_the_models_context_is_one_sentence(tiny_llama_dir, capsys):
    argv = ["--model", str(tiny_llama_dir), "--prefill-prompt-len", "1024", "--kv-cache-mib", "16"]
    assert run("e2e", e2e.main, argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bench.e2e: --prompt-len, --output-len, --prefill-prompt-len, --decode-output-len: "
        f"a request of 1028 tokens exceeds {tiny_llama_dir}'s context of 1024"
    )
