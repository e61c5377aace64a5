"""bench.transfer on a tiny model's KV shapes: the report's structure and byte counts, bad input."""

from __future__ import annotations

import json
import re

import pytest

from bench import transfer as bench_transfer
from bench.report import run
from engine.model_config import ModelConfig
from kv_store.layout import KVBlockLayout
from tests.unit.bench import MACHINE_KEYS


@pytest.mark.integration
def test_fp8_and_bf16_writes_move_every_block_over_nixl(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NIXL_LOG_LEVEL", raising=False)  # the bench sets it; undone after the test
    out = tmp_path / "transfer.json"
    argv = ["--model", str(tiny_llama_dir), "--num-tokens", "50", "--repetitions", "1", "--json", str(out)]
    assert bench_transfer.main(argv) == 0

    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    model = ModelConfig.from_dir(tiny_llama_dir)
    layouts = {d: KVBlockLayout(model.num_layers, model.num_kv_heads, model.head_dim, 16, d) for d in bench_transfer.KV_DTYPES}
    num_blocks = 4  # 50 tokens in 16-token blocks
    assert report["num_blocks"] == num_blocks
    assert report["layout"] == {"num_layers": model.num_layers, "num_kv_heads": model.num_kv_heads, "head_dim": model.head_dim, "block_size": 16}
    assert (report["fp8_block_bytes"], report["bf16_block_bytes"]) == (layouts["fp8_e4m3"].block_bytes, layouts["bf16"].block_bytes)
    assert report["codec_float_bytes"] == num_blocks * 2 * model.num_layers * model.num_kv_heads * 16 * model.head_dim * 4
    nixl = report["nixl"]
    for kv_dtype, layout in layouts.items():
        assert nixl[f"{kv_dtype}_scattered"]["num_descriptors"] == num_blocks  # no two decode blocks adjacent
        assert nixl[f"{kv_dtype}_contiguous"]["num_descriptors"] == 1
        for placement in ("scattered", "contiguous"):
            assert nixl[f"{kv_dtype}_{placement}"]["num_bytes"] == num_blocks * layout.block_bytes
        assert nixl["num_notifs_received"][kv_dtype] == 2 * (2 + 1)  # two placements x (2 warm-ups + 1 repetition)
    assert set(report["machine"]) == MACHINE_KEYS
    for phase in ("codec: ", "nixl: fp8_e4m3 WRITE of 4 blocks", "nixl: bf16 WRITE of 4 blocks"):
        assert re.search(rf"^\[bench\.transfer \d\d:\d\d:\d\d\] {phase}", captured.err, re.MULTILINE)


def test_a_model_that_is_not_there_is_one_sentence_naming_it(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert run("transfer", bench_transfer.main, ["--model", str(missing)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("bench.transfer: ") and str(missing) in lines[-1]
    assert all(line.startswith("[bench.transfer ") for line in lines[:-1])


def test_non_positive_counts_are_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        bench_transfer.main(["--repetitions", "0"])
    assert exited.value.code == 2
    assert "--repetitions" in capsys.readouterr().err
