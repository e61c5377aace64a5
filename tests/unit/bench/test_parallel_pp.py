"""bench.parallel --pp 2 on SmolLM2: PP 2's tokens against TP 1's, parameter and KV bytes per
stage, the step time and bubble share of its micro-batches; PP sizes above the layer count."""

from __future__ import annotations

import json

import pytest

from bench import parallel as bench_parallel
from bench.report import run
from engine.bundled import resolve_model
from engine.model_config import ModelConfig

FP32_BYTES = 4


@pytest.mark.slow
@pytest.mark.integration
def test_pp2_reports_its_stages_bytes_bubble_and_pp1_tokens(ray_session, keeps_torch_threads, tmp_path, capsys):
    out = tmp_path / "parallel_pp.json"
    argv = ["--quick", "--pp", "2", "--tp", "1", "--prompt-lengths", "32", "--batches", "4", "--json", str(out)]
    code = run("parallel", bench_parallel.main, argv)
    result = capsys.readouterr()
    assert code == 0, result.err

    report = json.loads(out.read_text())
    assert list(report["pp"]) == ["2"] and report["token_identical"] is True
    pp2 = report["pp"]["2"]
    assert pp2["token_identical"] is True
    assert list(pp2["decode_step_ms"]) == list(pp2["decode_itl_ms"]) == list(pp2["bubble_share"]) == ["4"]
    assert 0 <= pp2["bubble_share"]["4"] < 1 and pp2["decode_step_ms"]["4"] > 0
    # A stage holds its half of the layers (SmolLM2: 30 alike), the first the embedding, the last
    # the final norm and its own copy of the tied LM head; together PP 1's bytes and one more vocabulary.
    config = ModelConfig.from_dir(resolve_model("smollm2-135m", None))
    [pp1_bytes], (first, last) = report["param_bytes_per_stage"]["1"], report["param_bytes_per_stage"]["2"]
    vocab_bytes = config.vocab_size * config.hidden_size * FP32_BYTES
    assert config.tie_word_embeddings and first + last == pp1_bytes + vocab_bytes
    assert first - vocab_bytes == last - vocab_bytes - config.hidden_size * FP32_BYTES  # 15 layers each
    [pp1_kv], stage_kv = report["kv_bytes_per_stage"]["1"], report["kv_bytes_per_stage"]["2"]
    assert stage_kv == [pp1_kv // 2] * 2  # each stage's 15 layers of the same blocks
    assert "pp2-tp1 decode batch 4" not in result.err and "PP 2 x TP 1 decode batch 4: " in result.err


def test_a_pp_size_above_the_layer_count_names_the_layers(capsys):
    assert run("parallel", bench_parallel.main, ["--pp", "31", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()]
    assert err.startswith("bench.parallel: model 'smollm2-135m' has 30 layers, fewer than pipeline parallel size 31")
