"""bench.cpu_attention on a tiny model: both modes timed on alternating steps, the kernels left on."""

from __future__ import annotations

import json

import pytest

from bench import cpu_attention as bench_cpu_attention
from engine.kernels import cpu_attention


@pytest.mark.slow
def test_each_run_times_both_modes_on_half_the_steps(tiny_llama_dir, tmp_path):
    if not cpu_attention.NATIVE_ATTENTION:
        pytest.skip("engine.kernels._cpu_attention is not built")  # test_cpu_attention.py fails under SPLITSERVE_REQUIRE_NATIVE=1
    out = tmp_path / "cpu_attention.json"
    argv = ["--model", str(tiny_llama_dir), "--concurrency", "2", "--tokens", "6", "--repeats", "2", "--json", str(out)]
    assert bench_cpu_attention.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "cpu_attention" and report["kv_dtype"] == "fp8_e4m3" and len(report["runs"]) == 2
    for row in report["runs"]:  # 5 decode steps after the first token: 3 torch, 2 native
        assert row["torch_ms_per_step"]["steps"] == 3 and row["native_ms_per_step"]["steps"] == 2
        assert all(row[f"{mode}_ms_per_step"]["mean"] > 0 for mode in ("torch", "native"))
    assert cpu_attention.NATIVE_ATTENTION
