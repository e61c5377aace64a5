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
from bench.report import run
from bench.workload import random_workload
from tests.tiny_models import TINY_VOCAB

SYSTEMS = ["--systems", "splitserve", "transformers"]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MACHINE_KEYS = {"date", "cpu", "cpus", "torch_threads", "gpu"}


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
    assert set(report) == {"model", "dtype", "weights", "kv_dtype", "threads", "num_requests", "prompt_len", "output_len", "machine",
                           "results", "prompt_tok_per_s", "decode_tok_per_s", "speedup"}
    assert (report["weights"], report["threads"], report["machine"]["torch_threads"]) == ("fp32", 1, 1)
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
