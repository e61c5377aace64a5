"""bench.actor_engine's arithmetic and its refusals (the run itself needs Ray and a pinned CPU)."""

import pytest

from bench import actor_engine


def test_each_block_compares_the_actor_with_this_process_by_medians():
    here = [[(0.100, 0.099), (0.102, 0.1), (0.300, 0.1)], [(0.200, 0.19), (0.200, 0.19), (0.201, 0.19)]]
    actor = [[(0.098, 0.097), (0.099, 0.098), (0.097, 0.096)], [(0.210, 0.2), (0.190, 0.18), (0.212, 0.2)]]
    out = actor_engine.summarize(here, actor)
    assert out["actor_over_process_by_block"] == [round(0.098 / 0.102, 4), round(0.210 / 0.200, 4)]  # a slow outlier step does not move a block
    assert out["actor_over_process_mean"] == round((0.098 / 0.102 + 0.210 / 0.200) / 2, 4)
    assert (out["process_step_ms_p50"], out["actor_step_ms_p50"]) == (200.0, 144.5)


@pytest.mark.parametrize("argv", [["--blocks", "0"], ["--steps", "0"], ["--prompt-len", "1"]])
def test_bad_arguments_stop_it_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        actor_engine.main(argv)
    assert exit_.value.code == 2
    assert "must be at least" in capsys.readouterr().err
