"""The perf model: exact interpolation, the Splitwise row set it picks, and the profile JSON shape."""

from __future__ import annotations

import json
import math

import pytest

from planner.perf_model import PerfModel, load_profile, load_splitwise_csv

MODEL = PerfModel([(100, 0.01), (1000, 0.1), (2000, 0.3)], [(1, 0.02), (11, 0.03), (21, 0.05)], "test")


def test_interpolates_between_points_extends_the_last_segment_and_holds_the_first_value():
    assert MODEL.prefill_s(550) == pytest.approx(0.055)
    assert MODEL.prefill_s(1500) == pytest.approx(0.2)
    assert MODEL.prefill_s(3000) == pytest.approx(0.5)  # last segment's slope: 0.2 s per 1000 tokens
    assert MODEL.prefill_s(10) == 0.01
    assert MODEL.itl_s(6) == pytest.approx(0.025)
    assert MODEL.itl_s(31) == pytest.approx(0.07)
    assert MODEL.itl_s(0) == 0.02


def test_largest_batch_within_an_itl():
    assert MODEL.largest_batch(0.05, 256) == 21
    assert MODEL.largest_batch(0.0405, 256) == 16
    assert MODEL.largest_batch(0.05, 10) == 10
    assert MODEL.largest_batch(0.019, 256) == 0


def test_longest_prompt_is_the_inverse_of_prefill_time():
    assert MODEL.longest_prompt(0.1) == pytest.approx(1000)
    assert MODEL.longest_prompt(0.2) == pytest.approx(1500)
    assert MODEL.longest_prompt(0.5) == pytest.approx(3000)  # on the extended last segment
    assert MODEL.prefill_s(MODEL.longest_prompt(0.055)) == pytest.approx(0.055)
    assert MODEL.longest_prompt(0.005) == 0  # even one token takes the first point's 0.01 s
    assert MODEL.longest_prompt(0.02) > 100  # lengths below the first point cost its 0.01 s
    flat = PerfModel([(100, 0.01)], [(1, 0.02)])
    assert flat.longest_prompt(0.01) == math.inf and flat.longest_prompt(0.009) == 0


def test_splitwise_rows_of_one_model_hardware_and_tp(tmp_path):
    header = "model,hardware,prompt_size,batch_size,token_size,peak_power,average_power,prompt_time,token_time,e2e_time,tensor_parallel\n"
    rows = [
        "llama2-70b,h100-80gb,512,1,128,1,1,60,30,0,4",
        "llama2-70b,h100-80gb,512,1,256,1,1,62,28,0,4",
        "llama2-70b,h100-80gb,1024,1,128,1,1,100,30,0,4",
        "llama2-70b,h100-80gb,512,8,128,1,1,480,40,0,4",
        "llama2-70b,h100-80gb,512,1,128,1,1,999,999,0,8",
        "llama2-70b,a100-80gb,512,1,128,1,1,999,999,0,4",
    ]
    path = tmp_path / "perf.csv"
    path.write_text(header + "\n".join(rows) + "\n")
    model = load_splitwise_csv(path)
    assert model.prefill == ((512.0, pytest.approx(0.061)), (1024.0, pytest.approx(0.1)))
    assert model.decode == ((1.0, pytest.approx(0.029)), (8.0, pytest.approx(0.04)))
    assert model.source == "splitwise llama2-70b h100-80gb TP4"
    with pytest.raises(ValueError, match="no rows for llama2-70b on h100-80gb at TP 2"):
        load_splitwise_csv(path, tensor_parallel=2)


def test_a_profile_round_trips_and_a_bad_one_is_refused(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(MODEL.to_profile()))
    assert load_profile(path) == MODEL
    path.write_text(json.dumps({"prefill": [[100, 0.01]]}))
    with pytest.raises(ValueError, match="not a profile with 'prefill' and 'decode'"):
        load_profile(path)
    with pytest.raises(ValueError, match="decode: needs at least one point, every value above 0"):
        PerfModel([(100, 0.01)], [(1, -0.02)])
    with pytest.raises(ValueError, match="prefill: two points share an x value"):
        PerfModel([(100, 0.01), (100, 0.02)], [(1, 0.02)])
