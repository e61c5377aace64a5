"""bench.path's timing: the worker's own time comes off, the warm-up does not count."""

import time

import pytest

from bench import path
from proto import splitserve_pb2 as pb


def _stream(worker_first_token_s: float | None):
    def calls(i: int):
        time.sleep(0.004)  # the client's wait for its first response
        yield pb.GenerateResponse(token_ids=[i])
        last = pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH)
        if worker_first_token_s is not None:
            last.timings.worker_first_token_s = worker_first_token_s
        yield last

    return calls


def test_the_path_is_the_first_response_minus_the_workers_own_time():
    floor = path._time_first(_stream(None), requests=5, gap_s=0.0, worker_side=False)
    served = path._time_first(_stream(0.003), requests=5, gap_s=0.0, worker_side=True)
    assert len(floor) == len(served) == 5  # the 10 warm-up requests are dropped
    assert all(ms >= 4.0 for ms in floor)
    assert all(ms < min(floor) - 2.5 for ms in served)


def test_a_server_without_timings_is_refused():
    with pytest.raises(RuntimeError, match="no timings"):
        path._time_first(_stream(None), requests=1, gap_s=0.0, worker_side=True)


@pytest.mark.parametrize(
    "argv, message",
    [(["--requests", "0"], "--requests: must be at least 1"), (["--gap-s", "-1"], "--gap-s: must not be negative"), (["--engine-cpus", "0-x"], "--engine-cpus: '0-x' is not a CPU number")],
)
def test_bad_arguments_stop_the_bench_before_it_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        path.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
