"""bench.engine's llama.cpp peer on the bundled GGUF: batched streams, the shared vocabulary, the report.

Skipped where llama-cpp-python is not installed (`make bench-peers`; CI does not build it).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llama_cpp")

from bench import engine as bench_engine  # noqa: E402
from bench.llama_cpp_peer import LlamaCppPeer  # noqa: E402
from bench.report import run  # noqa: E402
from bench.workload import random_workload  # noqa: E402
from engine.bundled import bundled_model  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="module")
def peer():
    # One thread: on cores shared with other processes, a team of spinning threads waits on its slowest.
    peer = LlamaCppPeer(bundled_model("smollm2-135m").gguf_path(), num_threads=1, max_num_seqs=3, max_seq_len=64)
    yield peer
    peer.close()


def test_batched_streams_get_the_greedy_tokens_each_gets_alone(peer):
    workload = random_workload(4, (5, 20), (2, 5), SMOLLM2_VOCAB, seed=3)
    alone, batched = peer.serve(workload, 1), peer.serve(workload, 3)
    assert [len(out) for out in alone.output_token_ids] == [r.num_output_tokens for r in workload]
    assert batched.output_token_ids == alone.output_token_ids  # each stream read only its own sequence's KV
    assert batched.num_output_tokens == alone.num_output_tokens == sum(r.num_output_tokens for r in workload)
    assert len(batched.ttfts_s) == len(alone.ttfts_s) == len(workload)
    assert peer.prefill(list(workload[0].prompt_token_ids)) == alone.output_token_ids[0][0]


def test_its_tokenizer_splits_text_as_splitserves_does(peer, smollm2_dir):
    text = "Paged KV, 2 émigrés and <|im_start|> 1234."
    assert peer.vocab_size == SMOLLM2_VOCAB
    assert peer.tokenize(text) == Tokenizer.from_dir(smollm2_dir).encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_the_report_carries_llama_cpp_rows_probes_and_ratios(smollm2_dir, smollm2_cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(smollm2_cache_dir))
    out = tmp_path / "engine.json"
    argv = ["--num-requests", "2", "--concurrency", "1", "2", "--prompt-len", "4", "8", "--output-len", "2", "3", "--probe-len", "32", "4"]
    argv += ["--systems", "splitserve", "llama.cpp", "--kv-cache-bytes", str(8 << 20), "--threads", "1", "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        assert bench_engine.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets it for the process
    report = json.loads(out.read_text())
    assert [(r["system"], r["concurrency"]) for r in report["results"]] == [("splitserve", 1), ("llama.cpp", 1), ("splitserve", 2), ("llama.cpp", 2)]
    assert len({r["num_output_tokens"] for r in report["results"]}) == 1
    assert set(report["prompt_tok_per_s"]) == set(report["decode_tok_per_s"]) == {"splitserve", "llama.cpp"}
    assert set(report["vs_llama_cpp"]) == {"1", "2"} and report["speedup"] == {}
    assert {"vs_llama_cpp_prompt", "vs_llama_cpp_decode"} <= set(report)
    assert report["llama_cpp"]["threads"] == report["threads"] == report["machine"]["torch_threads"] == 1
    assert "OPENMP = 1" in report["llama_cpp"]["system_info"]


def test_a_model_without_a_gguf_file_is_one_sentence(tiny_llama_dir, capsys):
    argv = ["--model", str(tiny_llama_dir), "--systems", "llama.cpp", "--kv-cache-bytes", str(1 << 20)]
    assert run("engine", bench_engine.main, argv) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("bench.engine: llama.cpp needs a GGUF file") and "--gguf PATH" in last
