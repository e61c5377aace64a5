"""bench.moe --quick at EP 1 and 2: the report's structure, expert bytes per rank, identity, bad input; never speed."""

from __future__ import annotations

import json
import re

import pytest

from bench import moe as bench_moe
from bench.report import run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FP32_BYTES = 4


@pytest.mark.slow
@pytest.mark.integration
def test_quick_run_reports_every_figure_with_half_the_experts_per_rank_and_ep1_tokens(ray_session, keeps_torch_threads, tmp_path, capsys):
    """In this process, on the session's Ray (its ranks are Ray actors either way)."""
    out, png = tmp_path / "moe.json", tmp_path / "moe.png"
    code = run("moe", bench_moe.main, ["--quick", "--json", str(out), "--plot", str(png)])
    result = capsys.readouterr()
    assert code == 0, result.err

    report = json.loads(out.read_text())
    assert json.loads(result.out) == report
    assert {"ep", "token_identical", "expert_bytes_per_rank", "peer", "machine", "threads"} <= set(report)
    assert (report["model"]["dtype"], report["kv_dtype"], report["backend"]) == ("float32", "fp32", "gloo")
    assert set(report["ep"]) == set(report["threads"]) == {"1", "2"}
    batches = ["1", "8", "32"]
    for ep, figures in report["ep"].items():
        for key in ("decode_tok_s", "decode_itl_ms", "all_to_all_ms_per_step", "all_to_all_share_of_step"):
            assert list(figures[key]) == batches and all(v >= 0 for v in figures[key].values()), key
        assert len(figures["expert_bytes_per_rank"]) == len(figures["param_bytes_per_rank"]) == int(ep)
        assert figures["threads_per_rank"] == report["threads"][ep]
        assert figures["token_identical"] is True
    assert report["token_identical"] is True
    assert list(report["peer"]["decode_tok_s"]) == batches and report["peer"]["name"].startswith("transformers ")

    # 4 layers of 8 experts, each [gate; up] (2 x 1024 x 256) and down (256 x 1024), float32: EP 2
    # ranks hold 4 experts each, and everything else whole.
    model = report["model"]
    expert_bytes = model["num_hidden_layers"] * model["num_local_experts"] * 3 * model["intermediate_size"] * model["hidden_size"] * FP32_BYTES
    assert report["expert_bytes_per_rank"] == {"1": expert_bytes, "2": expert_bytes // 2}
    assert report["ep"]["2"]["expert_bytes_per_rank"] == [expert_bytes // 2] * 2
    assert report["expert_bytes_ratio_to_ep1"] == {"1": 1.0, "2": 0.5}
    (ep1_params,), ep2_params = report["ep"]["1"]["param_bytes_per_rank"], report["ep"]["2"]["param_bytes_per_rank"]
    assert ep2_params == [ep1_params - expert_bytes // 2] * 2
    assert model["expert_share_of_params"] > 0.9

    # The same tokens go to the same experts at either size; EP 2's ranks split them.
    assert sum(report["ep"]["2"]["expert_tokens_per_rank"]) == sum(report["ep"]["1"]["expert_tokens_per_rank"])
    assert report["ep"]["2"]["expert_load_max_over_mean"] == report["ep"]["1"]["expert_load_max_over_mean"]

    assert png.read_bytes().startswith(PNG_MAGIC)
    for phase in ["EP 2 decode batch 1", "EP 2 decode batch 32", "transformers decode batch 8"]:
        assert re.search(rf"^\[bench\.moe \d\d:\d\d:\d\d\] {phase}: ", result.err, re.MULTILINE)


def test_an_ep_size_the_experts_do_not_allow_is_one_sentence_naming_the_sizes_that_work(capsys):
    assert run("moe", bench_moe.main, ["--ep", "1,3", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err == "bench.moe: model 'tiny-mixtral' has 8 experts, which do not divide by expert parallel size 3. Sizes that work: 1, 2, 4, 8\n"


@pytest.mark.parametrize("flag", [["--ep", "2"], ["--ep", "1,x"], ["--batches", "0"], ["--batches", "1,,8"], ["--threads", "2"]])
def test_bad_options_are_refused_before_anything_loads(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        bench_moe.main(flag)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"error: (argument |unrecognized arguments: )?--", err.splitlines()[-1])
