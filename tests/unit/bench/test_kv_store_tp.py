"""bench.kv_store --tp / --ep: a TP 3 replica of a tiny llama with 3 KV heads and an EP 2 replica
of a tiny Mixtral (their ranks 1 and up on the session's FollowerHosts), with a real redis-server:
the report's structure, each tier's whole prefix, the leader's slice through Redis, which rank
served each tier at EP 2; TP sizes the model's heads do not allow, EP on a model without experts."""

from __future__ import annotations

import json
import re

import pytest

from bench import kv_store as bench_kv_store
from bench.report import run
from engine.model_config import ModelConfig
from kv_store.layout import KVBlockLayout
from tests.unit.bench import MACHINE_KEYS

TIERS = ["recompute", "gpu", "cpu", "redis"]


@pytest.mark.slow
@pytest.mark.integration
def test_tp3_every_tier_serves_the_whole_prefix_and_redis_moves_the_leaders_heads(ranks_on_hosts, keeps_torch_threads, tiny_checkpoint, tmp_path, capsys):
    model_dir = tiny_checkpoint("llama-kv3")
    out = tmp_path / "kv_store_tp3.json"
    argv = ["--model", str(model_dir), "--tp", "3", "--prefix-tokens", "64", "--repeats", "2", "--json", str(out)]
    code = run("kv_store", bench_kv_store.main, argv)  # starts its own redis-server
    captured = capsys.readouterr()
    assert code == 0, captured.err

    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert report["tp_size"] == 3
    assert list(report["ttft_s"]) == list(report["ttft_over_recompute"]) == list(report["ttft_s_all"]) == TIERS
    assert report["cached_tokens"] == {"recompute": [0, 0], "gpu": [64, 64], "cpu": [64, 64], "redis": [64, 64]}
    model = ModelConfig.from_dir(model_dir)
    assert model.num_kv_heads == 3
    leader_block_bytes = KVBlockLayout(model.num_layers, 1, model.head_dim, 16, "fp8_e4m3").block_bytes  # one KV head per rank
    assert (report["redis_blocks"], report["redis_bytes"]) == (4, 4 * leader_block_bytes)
    assert {"redis_put_gbps", "redis_get_gbps", "raw_redis_py_set_gbps", "raw_redis_py_get_gbps"} <= set(report)
    assert set(report["machine"]) == MACHINE_KEYS
    for tier in TIERS:
        assert re.search(rf"^\[bench\.kv_store \d\d:\d\d:\d\d\] {tier}: loading .* over 3 rank\(s\)", captured.err, re.MULTILINE)
        assert re.search(rf"^\[bench\.kv_store \d\d:\d\d:\d\d\] {tier}: TTFT ", captured.err, re.MULTILINE)


def test_a_tp_size_the_heads_do_not_allow_is_one_sentence_naming_the_sizes_that_work(capsys):
    assert run("kv_store", bench_kv_store.main, ["--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()]
    assert err.startswith("bench.kv_store: model 'smollm2-135m' (9 attention heads, 3 KV heads)") and "Sizes that work: 1, 3" in err


@pytest.mark.parametrize("tp", ["0", "x", "-3"])
def test_a_tp_size_that_is_not_a_positive_number_is_refused(tp, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_kv_store.main(["--tp", tp])
    assert exited.value.code == 2
    assert re.search(r"error: argument --tp", capsys.readouterr().err.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.integration
def test_ep2_rank_1_serves_its_own_pool_and_cpu_blocks_and_rank_0_reads_its_redis_spills(ranks_on_hosts, keeps_torch_threads, tiny_checkpoint, tmp_path, capsys):
    model_dir = tiny_checkpoint("mixtral")
    out = tmp_path / "kv_store_ep2.json"
    argv = ["--model", str(model_dir), "--ep", "2", "--prefix-tokens", "64", "--repeats", "2", "--json", str(out)]
    code = run("kv_store", bench_kv_store.main, argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err

    report = json.loads(out.read_text())
    assert (report["tp_size"], report["ep_size"]) == (1, 2)
    assert report["cached_tokens"] == {"recompute": [0, 0], "gpu": [64, 64], "cpu": [64, 64], "redis": [64, 64]}
    assert report["measured_rank"] == {"recompute": [0, 0], "gpu": [1, 1], "cpu": [1, 1], "redis": [0, 0]}
    model = ModelConfig.from_dir(model_dir)
    block_bytes = KVBlockLayout(model.num_layers, model.num_kv_heads, model.head_dim, 16, "fp8_e4m3").block_bytes  # every head: data-parallel attention
    assert (report["redis_blocks"], report["redis_bytes"]) == (4, 4 * block_bytes)
    assert re.search(r"^\[bench\.kv_store \d\d:\d\d:\d\d\] redis: loading .* over 2 rank\(s\)", captured.err, re.MULTILINE)


def test_ep_on_a_model_without_experts_is_one_sentence(capsys):
    assert run("kv_store", bench_kv_store.main, ["--model", "smollm2-135m", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()]
    assert err.startswith("bench.kv_store: model 'smollm2-135m' (LlamaForCausalLM) has no experts")


def test_ep_with_tp_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_kv_store.main(["--ep", "2", "--tp", "3"])
    assert exited.value.code == 2
    assert "error: --ep: a replica is tensor-parallel or expert-parallel, not both (--tp 3, --ep 2)" in capsys.readouterr().err
