"""bench.routing end to end on a small generated trace: the report's structure and counts, the plot, bad input."""

from __future__ import annotations

import json
import re

import pytest

from bench import routing as bench_routing
from bench.report import run
from bench.traces import TraceConfig, generate, write_trace
from router.routing.policy import POLICIES
from tests.unit.bench import MACHINE_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL_CLUSTER = ["--workers", "2", "--pool-tokens", "4096", "--cpu-tokens", "8192", "--redis-tokens", "32768", "--num-decode-workers", "2"]


@pytest.fixture
def trace_path(tmp_path):
    config = TraceConfig(request_rate=4.0, num_tenants=4, num_agent_apps=2, tool_prompt_tokens_max=8000, warmup_s=30.0)
    path = tmp_path / "mixed.jsonl"
    write_trace(generate("mixed", 150, seed=1, config=config), path)
    return path


def test_every_policy_is_replayed_and_its_tier_hits_add_up(trace_path, tmp_path, capsys):
    out, png = tmp_path / "routing.json", tmp_path / "routing.png"
    argv = ["--trace", str(trace_path), "--warmup-s", "0", *SMALL_CLUSTER, "--json", str(out), "--plot", str(png)]
    assert bench_routing.main(argv) == 0

    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert set(report) == {"trace", "trace_stats", "warmup_s", "cluster", "splitserve_config", "oracle_hit_ratio", "policies", "goals", "machine"}
    assert set(report["machine"]) == MACHINE_KEYS
    assert report["trace_stats"]["num_requests"] == 150 and report["cluster"]["num_workers"] == 2
    assert list(report["policies"]) == list(POLICIES)
    for name, result in report["policies"].items():
        assert result["num_requests"] == 150  # no warm-up: every request counted
        assert result["hit_ratio"] == pytest.approx(result["hit_ratio_pool"] + result["hit_ratio_cpu"] + result["hit_ratio_redis"])
        assert len(result["prefill_tokens_computed"]) == 2
        assert re.search(rf"^\[bench\.routing \d\d:\d\d:\d\d\] {name}: hit ratio ", captured.err, re.MULTILINE)
    assert set(report["goals"]) == {"hit_ratio_over_oracle", "load_max_over_mean", "ttft_s_p90_below_every_baseline", "decide_us_p99_32k"}
    assert png.read_bytes().startswith(PNG_MAGIC)


def _one_sentence(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench.routing: ") and "Traceback" not in err
    return err


def test_a_trace_that_does_not_exist_is_one_sentence(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    assert run("routing", bench_routing.main, ["--trace", str(missing)]) == 2
    assert str(missing) in _one_sentence(capsys)


@pytest.mark.parametrize("second_line", ["not json", '{"timestamp": 5, "input_length": 10}', "[1, 2]", '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": 7}'])
def test_a_file_that_is_not_a_mooncake_trace_is_one_sentence_naming_the_line(second_line, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 1]}\n' + second_line + "\n")
    assert run("routing", bench_routing.main, ["--trace", str(path)]) == 2
    err = _one_sentence(capsys)
    assert "not a Mooncake JSONL trace" in err and "line 2" in err


def test_a_warm_up_longer_than_the_trace_is_one_sentence(trace_path, capsys):
    assert run("routing", bench_routing.main, ["--trace", str(trace_path), "--warmup-s", "100000"]) == 2
    assert "--warmup-s" in _one_sentence(capsys)


def test_a_cluster_without_workers_is_refused(trace_path, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_routing.main(["--trace", str(trace_path), "--workers", "0"])
    assert exited.value.code == 2
    assert "num_workers" in capsys.readouterr().err
