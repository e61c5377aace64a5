"""bench.kv_store on a tiny model and a real redis-server: the report's structure and counts, bad input."""

from __future__ import annotations

import json
import re

import pytest

from bench import kv_store as bench_kv_store
from bench.report import run
from engine.model_config import ModelConfig
from kv_store.layout import KVBlockLayout
from tests.redis_server import free_port
from tests.unit.bench import MACHINE_KEYS

TIERS = ["recompute", "gpu", "cpu", "redis"]


@pytest.mark.integration
def test_every_tier_serves_the_whole_prefix_and_redis_moves_every_block(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "kv_store.json"
    argv = ["--model", str(tiny_llama_dir), "--prefix-tokens", "64", "--repeats", "2", "--json", str(out)]
    assert bench_kv_store.main(argv) == 0  # starts its own redis-server

    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert list(report["ttft_s"]) == list(report["ttft_over_recompute"]) == list(report["ttft_s_all"]) == TIERS
    assert all(len(times) == 2 for times in report["ttft_s_all"].values())
    assert report["cached_tokens"] == {"recompute": [0, 0], "gpu": [64, 64], "cpu": [64, 64], "redis": [64, 64]}
    model = ModelConfig.from_dir(tiny_llama_dir)
    block_bytes = KVBlockLayout(model.num_layers, model.num_kv_heads, model.head_dim, 16, "fp8_e4m3").block_bytes
    assert (report["redis_blocks"], report["redis_bytes"]) == (4, 4 * block_bytes)
    assert {"redis_put_gbps", "redis_get_gbps", "raw_redis_py_set_gbps", "raw_redis_py_get_gbps"} <= set(report)
    assert set(report["machine"]) == MACHINE_KEYS
    assert re.search(r"^\[bench\.kv_store \d\d:\d\d:\d\d\] started redis-server at redis://127\.0\.0\.1:", captured.err, re.MULTILINE)
    for tier in TIERS:
        assert re.search(rf"^\[bench\.kv_store \d\d:\d\d:\d\d\] {tier}: TTFT ", captured.err, re.MULTILINE)


def test_a_redis_url_nothing_answers_at_is_one_sentence(capsys):
    url = f"redis://127.0.0.1:{free_port()}/0"  # a free port: nothing listens there
    assert run("kv_store", bench_kv_store.main, ["--redis-url", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"bench.kv_store: no Redis answers at --redis-url {url}")


def test_a_url_that_is_not_redis_is_one_sentence(capsys):
    assert run("kv_store", bench_kv_store.main, ["--redis-url", "http://127.0.0.1:1/"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench.kv_store: ")


def test_a_prefix_shorter_than_one_block_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_kv_store.main(["--prefix-tokens", "15"])
    assert exited.value.code == 2
    assert "--prefix-tokens" in capsys.readouterr().err
