"""bench.parallel --quick on SmolLM2 at TP 1 and 3: the report's structure, parameter bytes per rank, identity, bad input."""

from __future__ import annotations

import json
import re

import pytest

from bench import parallel as bench_parallel
from bench.report import run
from engine.bundled import resolve_model
from engine.model_config import ModelConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FP32_BYTES = 4


@pytest.mark.slow
@pytest.mark.integration
def test_quick_run_reports_every_figure_with_shards_of_a_third_and_tp1_tokens(ray_session, keeps_torch_threads, tmp_path, capsys):
    """In this process, on the session's Ray (its ranks are Ray actors either way)."""
    out, png = tmp_path / "parallel.json", tmp_path / "parallel.png"
    code = run("parallel", bench_parallel.main, ["--quick", "--json", str(out), "--plot", str(png)])
    result = capsys.readouterr()
    assert code == 0, result.err

    report = json.loads(out.read_text())
    assert json.loads(result.out) == report
    assert (report["dtype"], report["kv_dtype"], report["backend"]) == ("float32", "fp32", "gloo")
    assert set(report["tp"]) == {"1", "3"} and set(report["threads"]) == {"1", "3"}
    lengths = [str(n) for n in bench_parallel.QUICK["prompt_lengths"]]
    for tp, figures in report["tp"].items():
        assert list(figures["prefill_s"]) == lengths and all(s > 0 for s in figures["prefill_s"].values())
        assert list(figures["decode_itl_ms"]) == ["1", "16"] and all(ms > 0 for ms in figures["decode_itl_ms"].values())
        assert len(figures["param_bytes_per_rank"]) == int(tp)
        assert len(figures["load_avg_1m"]) == 2 and figures["threads_per_rank"] == report["threads"][tp]
        assert figures["token_identical"] is True
    assert report["token_identical"] is True

    # Every rank holds 1/3 of each sharded tensor (SmolLM2's 3 KV heads and 49152-token vocabulary
    # split evenly, no padding) plus a full copy of the RMSNorm weights: two per layer and the final one.
    # So TP1 / 3 <= a rank's bytes, and the norms are far below TP1 / 6, which keeps it under TP1 / 2.
    config = ModelConfig.from_dir(resolve_model("smollm2-135m", None))
    norm_bytes = (2 * config.num_layers + 1) * config.hidden_size * FP32_BYTES
    tp1, tp3 = report["param_bytes_per_rank"]["1"], report["param_bytes_per_rank"]["3"]
    assert report["tp"]["3"]["param_bytes_per_rank"] == [tp3] * 3
    assert tp1 / 3 <= tp3 <= tp1 / 2
    assert 3 * tp3 == tp1 + 2 * norm_bytes
    assert report["param_bytes_ratio_to_tp1"]["3"] == round(tp3 / tp1, 4)

    assert png.read_bytes().startswith(PNG_MAGIC)
    for phase in ["prefill 32 tokens", "prefill 128 tokens", "decode batch 1", "decode batch 16"]:
        assert re.search(rf"^\[bench\.parallel \d\d:\d\d:\d\d\] TP 3 {phase}: ", result.err, re.MULTILINE)


def test_a_tp_size_the_heads_do_not_allow_is_one_sentence_naming_the_sizes_that_work(capsys):
    assert run("parallel", bench_parallel.main, ["--tp", "1,2", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()]
    assert err.startswith("bench.parallel: model 'smollm2-135m' (9 attention heads, 3 KV heads)") and "Sizes that work: 1, 3" in err


def test_a_prompt_longer_than_the_context_is_one_sentence(capsys):
    assert run("parallel", bench_parallel.main, ["--prompt-lengths", "512,8192"]) == 2
    assert capsys.readouterr().err == "bench.parallel: --prompt-lengths: 8192 tokens and the first output token do not fit smollm2-135m's context of 8192\n"


@pytest.mark.parametrize("flag", [["--tp", "3"], ["--tp", "1,x"], ["--batches", "0"], ["--decode-tokens", "-1"], ["--prompt-lengths", "512,,8000"]])
def test_bad_options_are_refused_before_anything_loads(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_parallel.main(flag)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"error: (argument )?--", err.splitlines()[-1])
