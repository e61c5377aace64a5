"""bench.engine on a tiny model: the report's structure and token counts, the plot, bad input.

The llama.cpp peer has its own tests (test_engine_llama_cpp.py); CI does not install it, so here
it is left out of --systems, or found missing on purpose.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from bench import engine as bench_engine
from bench.llama_cpp_peer import INSTALL_HINT
from bench.report import SIMD_FLAGS, machine, run
from bench.workload import random_workload
from tests.tiny_models import TINY_VOCAB
from tests.unit.bench import MACHINE_KEYS

SYSTEMS = ["--systems", "splitserve", "transformers"]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_the_machine_names_the_simd_features_the_kernels_were_chosen_by():
    """A report's ``cpu_flags`` tell an AVX2 box from an AVX-512 one under the same model name;
    they must agree with the instruction set the quantized kernels picked on this CPU."""
    from engine.quant import native

    flags = machine()["cpu_flags"]
    assert list(flags) == [flag for flag in SIMD_FLAGS if flag in flags]
    # The best set the CPU runs (isas() is slowest first), not isa(): a test may switch that one.
    isa = native._qmatmul.isas()[-1] if native._qmatmul is not None else "scalar"
    wanted = {"avx512vnni": {"avx2", "avx512f", "avx512_vnni"}, "avx2": {"avx2"}, "scalar": set()}[isa]
    assert wanted <= set(flags), (isa, flags)
    if isa == "avx2":
        assert "avx512_vnni" not in flags or "avx512f" not in flags
    if native._qmatmul is not None:
        assert native._qmatmul.cpu_has_bf16() == bool({"avx512_bf16", "amx_bf16"} & set(flags))


@pytest.mark.slow
def test_both_systems_at_each_concurrency_emit_every_workload_token(tiny_llama_dir, tmp_path, capsys):
    out, png = tmp_path / "engine.json", tmp_path / "engine.png"
    argv = ["--model", str(tiny_llama_dir), "--num-requests", "4", "--concurrency", "1", "2", "--prompt-len", "4", "8"]
    argv += ["--output-len", "2", "4", "--kv-cache-bytes", str(1 << 20), "--json", str(out), "--plot", str(png)]
    threads = torch.get_num_threads()
    try:
        assert bench_engine.main(argv + SYSTEMS + ["--weights", "fp32", "--threads", "1", "--probe-len", "64", "8"]) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets it for the process

    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    assert json.loads(captured.out) == report
    assert set(report) == {"model", "dtype", "weights", "act_planes", "kv_dtype", "threads", "num_requests", "prompt_len", "output_len", "machine",
                           "results", "prompt_tok_per_s", "decode_tok_per_s", "speedup"}
    assert (report["weights"], report["act_planes"], report["threads"], report["machine"]["torch_threads"]) == ("fp32", 2, 1, 1)
    assert set(report["machine"]) == MACHINE_KEYS
    for probe in ("prompt_tok_per_s", "decode_tok_per_s"):
        assert set(report[probe]) == {"splitserve", "transformers"} and all(v > 0 for v in report[probe].values())
    workload = random_workload(4, (4, 8), (2, 4), TINY_VOCAB, seed=0)
    num_output_tokens = sum(r.num_output_tokens for r in workload)
    runs = [(r["system"], r["concurrency"]) for r in report["results"]]
    assert runs == [("splitserve", 1), ("transformers", 1), ("splitserve", 2), ("transformers", 2)]
    for result in report["results"]:
        assert result["num_output_tokens"] == num_output_tokens
        assert set(result) == {"system", "concurrency", "output_tok_per_s", "ttft_s_p50", "ttft_s_p99", "num_output_tokens", "wall_s"}
    assert set(report["speedup"]) == {"1", "2"}
    assert png.read_bytes().startswith(PNG_MAGIC)
    for system, concurrency in runs:
        assert re.search(rf"^\[bench\.engine \d\d:\d\d:\d\d\] {system} N={concurrency}: ", captured.err, re.MULTILINE)
    for system in ("splitserve", "transformers"):
        assert re.search(rf"^\[bench\.engine \d\d:\d\d:\d\d\] {system}: prompt [\d.]+ tok/s \(64 tokens\), decode [\d.]+ tok/s \(8 tokens\)$", captured.err, re.MULTILINE)


def test_llama_cpp_missing_is_one_sentence_saying_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `import llama_cpp` meets where it is not installed
    assert run("engine", bench_engine.main, []) == 2  # llama.cpp is a default system
    assert capsys.readouterr().err.splitlines() == [f"bench.engine: {INSTALL_HINT}"]  # before anything loads


def test_a_model_that_is_not_there_is_one_sentence_naming_it(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert run("engine", bench_engine.main, ["--model", str(missing), "--num-requests", "1", "--concurrency", "1"] + SYSTEMS) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("bench.engine: ") and str(missing) in lines[-1]
    assert all(line.startswith("[bench.engine ") for line in lines[:-1])  # progress lines only, no traceback


@pytest.mark.parametrize("flag", [["--concurrency", "0"], ["--num-requests", "0"], ["--prompt-len", "9", "8"], ["--weights", "int3"], ["--threads", "0"], ["--probe-len", "64", "1"]])
def test_bad_counts_are_refused_before_anything_loads(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_engine.main(flag)
    assert exited.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_spec_ngram_adds_acceptance_and_speedups_per_workload(tiny_llama_dir, tmp_path, capsys):
    """`bench.engine --spec ngram` measures speculative decoding against off on the copy-heavy and
    the chat workload at c1 and c8 (bench.spec), beside the usual rows."""
    out = tmp_path / "engine.json"
    argv = ["--model", str(tiny_llama_dir), "--systems", "splitserve", "--num-requests", "2", "--concurrency", "1", "--prompt-len", "4", "8",
            "--output-len", "2", "4", "--kv-cache-bytes", str(1 << 22), "--weights", "fp32", "--threads", "1", "--probe-len", "16", "4",
            "--spec", "ngram", "--spec-requests", "2", "--spec-max-tokens", "6", "--spec-repeats", "1", "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        assert bench_engine.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert set(report["spec"]) == {"copy", "chat"}
    for row in report["spec"].values():
        assert {"acceptance", "speedup_c1", "speedup_c8", "num_draft_tokens"} <= set(row)
        assert 0.0 <= row["acceptance"] <= 1.0 and row["speedup_c1"] > 0 and row["speedup_c8"] > 0
    err = capsys.readouterr().err
    assert re.search(r"^\[bench\.spec \d\d:\d\d:\d\d\] copy c8 ngram: \d+ tokens", err, re.MULTILINE)


def test_fewer_requests_than_the_concurrency_are_refused_naming_both(capsys):
    """16 requests never put 32 in flight: such a row would report concurrency 16 as 32."""
    with pytest.raises(SystemExit) as exited:
        bench_engine.main(["--num-requests", "16", "--concurrency", "1", "32"])
    assert exited.value.code == 2
    assert "--num-requests: 16 requests never reach --concurrency 32" in capsys.readouterr().err


def test_roofline_rows_count_every_weight_once_and_each_sequences_kv(tiny_llama_dir):
    """The roofline's bytes, on the CPU engine (the rows are the same code on CUDA): every weight
    once per step but the embedding table (the tiny model's LM head is its own, so a lookup
    reads a row per token), KV of every sequence at the middle step's context, and tok/s from
    the median step."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), weights="fp32", kv_dtype="fp8_e4m3", num_kv_blocks=64))
    model, layout = engine.runner.model, engine.kv_cache.layout
    assert not model.config.tie_word_embeddings
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if not name.startswith("embed_tokens"))
    rows = bench_engine.roofline_rows(engine, [1, 3], context=20, num_steps=6, peak=None, copy_bw=1e9)
    assert [r["concurrency"] for r in rows] == [1, 3]
    for row in rows:
        mid = 20 + 1 + 6 // 2  # the prompt, the first token, then the middle of 6 decode steps
        kv = row["concurrency"] * (mid * layout.payload_bytes / layout.block_size + -(-mid // layout.block_size) * layout.scale_bytes)
        assert row["weight_bytes"] == weight_bytes
        assert row["kv_bytes_per_step"] == round(kv)
        seconds = row["ms_per_step"] / 1e3
        assert row["tok_per_s"] == pytest.approx(row["concurrency"] / seconds, rel=0.01)
        assert row["gb_per_s"] == pytest.approx((weight_bytes + kv) / seconds / 1e9, rel=0.01, abs=0.1)
        assert row["fraction_of_copy"] == pytest.approx((weight_bytes + kv) / seconds / 1e9, rel=0.01, abs=0.002)  # copy_bw is 1 GB/s
        assert "fraction_of_hbm_peak" not in row  # no peak known
    assert not engine.has_unfinished_requests() and engine.pool.num_free_blocks == 64


def test_cuda_bench_options_refused_without_a_gpu_or_with_llama_cpp(capsys):
    with pytest.raises(SystemExit) as e:
        bench_engine.main(["--device", "cuda", "--systems", "splitserve", "llama.cpp"])
    assert e.value.code == 2
    assert "--systems: the llama.cpp peer runs on the CPU here" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench_engine.main(["--device", "cuda"])
        assert "--device cuda: torch sees no CUDA GPU on this machine" in capsys.readouterr().err
