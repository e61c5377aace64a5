"""bench.kernels on CPU: its report's structure on small inputs (never its speed), and its refusals."""

from __future__ import annotations

import json

import pytest

from bench import kernels
from engine.kernels import cpu_attention
from engine.layers import norm
from engine.quant import native


@pytest.mark.slow
def test_the_cpu_report_times_each_matmul_peer_and_both_engines_on_the_same_steps(tiny_llama_dir, tmp_path, monkeypatch):
    if not (native.NATIVE_QMATMUL and cpu_attention.NATIVE_ATTENTION and norm.NATIVE_NORM):
        pytest.skip("the C kernels are not built here")  # their own tests fail under SPLITSERVE_REQUIRE_NATIVE=1
    monkeypatch.setattr(kernels, "MATMUL_SHAPES", (("q4", 48, 64), ("q8", 32, 32)))
    out = tmp_path / "kernels.json"
    argv = ["--device", "cpu", "--model", str(tiny_llama_dir), "--threads", "1", "--rows", "1", "3", "--repeats", "1",
            "--concurrency", "1", "2", "--tokens", "5", "--json", str(out)]
    assert kernels.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["isa"] != "scalar"
    assert [(r["shape"], r["rows"]) for r in report["matmul"]] == [("48x64", 1), ("48x64", 3), ("32x32", 1), ("32x32", 3)]
    assert all(r[f"{peer}_us"] > 0 for r in report["matmul"] for peer in ("native", "torch_int4", "dense_bf16"))
    assert [(r["concurrency"], r["steps"]) for r in report["decode_steps"]] == [(1, 5), (2, 5)]  # tokens after the first
    assert all(r[f"{mode}_ms_per_step"] > 0 for r in report["decode_steps"] for mode in ("native", "kernels_only", "torch"))
    assert native.NATIVE_QMATMUL and cpu_attention.NATIVE_ATTENTION and norm.NATIVE_NORM  # switched back on
    assert report["device_path"] == {
        "launches_per_decode_layer": 5, "launches_per_decode_layer_split_k": 6, "gemms": 4, "torch_ops": {},
        "triton": {"add_rms_norm": 2, "rope_write_kv": 1, "paged_decode_attention": 1, "silu_and_mul": 1},
    }


def test_kernels_that_are_not_built_are_named_and_nothing_is_measured(monkeypatch, capsys):
    monkeypatch.setattr(norm, "NATIVE_NORM", False)
    assert kernels.run("kernels", kernels.main, ["--device", "cpu"]) == 2
    assert "NATIVE_NORM false" in capsys.readouterr().err


def test_cuda_without_a_gpu_exits_2_with_a_sentence(monkeypatch, capsys):
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: False)
    assert kernels.run("kernels", kernels.main, ["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
