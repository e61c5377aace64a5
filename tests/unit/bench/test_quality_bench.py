"""bench.quality on a tiny model: the report's structure, its perplexity against transformers', the
greedy comparison's counts, the 2:4 row, progress on stderr and bad input — not its speed."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from bench import quality
from bench.report import run
from engine.tokenizer import Tokenizer

WINDOW, TEXT_TOKENS, GEN_TOKENS = 64, 200, 6
WEIGHTS = ["fp32", "int8", "int4"]
ONE_PLANE = ["int4/a8"]


@pytest.fixture(scope="module")
def report(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "quality.json"
    argv = ["--model", str(tiny_llama_dir), "--weights", *WEIGHTS, "--window", str(WINDOW), "--max-text-tokens", str(TEXT_TOKENS),
            "--gen-tokens", str(GEN_TOKENS), "--decode-tokens", "4", "--threads", "1", "--one-plane", "int4", "--json", str(out)]
    threads = torch.get_num_threads()
    try:
        assert quality.main(argv) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets it for the process
    return json.loads(out.read_text())


def test_one_row_per_weights_format_then_the_pruned_row_each_scoring_every_token_after_a_windows_first(report):
    assert [row["weights"] for row in report["rows"]] == WEIGHTS + ONE_PLANE + [quality.PRUNED]
    assert {"bench", "model", "machine", "text", "window", "max_text_tokens", "gen_tokens", "decode_tokens", "threads", "one_plane", "rows"} <= set(report)
    # 200 tokens in windows of 64, 64, 64, 8: each window's first token has nothing to be predicted from
    assert all(row["scored_tokens"] == TEXT_TOKENS - math.ceil(TEXT_TOKENS / WINDOW) for row in report["rows"])
    for row in report["rows"][: len(WEIGHTS) + len(ONE_PLANE)]:
        assert set(row) == {"weights", "perplexity", "scored_tokens", "decode_tok_per_s_c1", "linear_weight_bytes", "greedy_vs_fp32"}
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1 and row["decode_tok_per_s_c1"] > 0
    fp32, int8, int4, int4_a8 = (row["linear_weight_bytes"] for row in report["rows"][: len(WEIGHTS) + len(ONE_PLANE)])
    assert int4 == int4_a8 < int8 < fp32


def test_the_one_plane_row_runs_the_same_weights_with_other_activations(report):
    """The same int4 weights; one activation plane moves the perplexity (the setting reached the kernel)."""
    rows = {row["weights"]: row for row in report["rows"]}
    assert rows["int4/a8"]["perplexity"] != rows["int4"]["perplexity"]


def test_greedy_counts_are_bounded_by_the_tokens_generated_and_fp32_agrees_with_itself(report):
    tokens = len(quality.PROMPTS) * GEN_TOKENS
    for row in report["rows"][: len(WEIGHTS) + len(ONE_PLANE)]:
        counts = row["greedy_vs_fp32"]
        assert counts["tokens"] == tokens
        assert 0 <= counts["agree_before_divergence"] <= counts["agree_total"] <= tokens
    assert report["rows"][0]["greedy_vs_fp32"] == {"agree_before_divergence": tokens, "agree_total": tokens, "tokens": tokens}


def test_the_pruned_row_zeroes_half_the_linear_weights(report):
    pruned = report["rows"][-1]
    assert set(pruned) == {"weights", "perplexity", "scored_tokens", "prune_stats"}
    stats = pruned["prune_stats"]
    assert stats["weights_pruned"] * 2 == stats["weights_total"] > 0


def test_fp32_perplexity_is_transformers_perplexity_over_the_same_windows(report, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = Tokenizer.from_dir(tiny_llama_dir).encode(quality.TEXT_PATH.read_text(encoding="utf-8"))[:TEXT_TOKENS]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, WINDOW):
            chunk = torch.tensor([ids[start : start + WINDOW]])
            log_probs = torch.log_softmax(model(chunk).logits[0, :-1].float(), dim=-1)
            nll -= log_probs.gather(1, chunk[0, 1:, None]).sum().item()
            count += chunk.shape[1] - 1
    assert report["rows"][0]["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-3)


def test_each_phase_is_announced_on_stderr(tiny_llama_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_llama_dir), "--weights", "fp32", "--window", "16", "--max-text-tokens", "20", "--gen-tokens", "2", "--decode-tokens", "2"]
    threads = torch.get_num_threads()
    try:
        assert quality.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    for phase in ("weights fp32: loading", "weights fp32: perplexity", "weights fp32: greedy generations and c1 decode", f"{quality.PRUNED}: loading and pruning"):
        assert re.search(rf"^\[bench\.quality \d\d:\d\d:\d\d\] {re.escape(phase)}$", err, re.MULTILINE)


@pytest.mark.parametrize(
    "argv, sentence",
    [
        (["--weights", "int8"], "bench.quality: --weights: fp32 must be among them, the generations are compared with it"),
        (["--weights", "fp32", "--window", "100000"], "is longer than"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_status_2(tiny_llama_dir, argv, sentence, capsys):
    assert run("quality", quality.main, ["--model", str(tiny_llama_dir), *argv]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("bench.quality: ") and sentence in last


def test_a_model_that_is_not_there_is_named(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert run("quality", quality.main, ["--model", str(missing), "--weights", "fp32"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("bench.quality: ") and str(missing) in lines[-1]
    assert all(line.startswith("[bench.quality ") for line in lines[:-1])  # progress lines only, no traceback
