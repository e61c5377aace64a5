"""SplitServeClient's failover between routers, against stand-in routers in their own processes
(tests/unit/router/dying_router.py) that are killed mid-stream: real gRPC on loopback, real
connection resets, the real resume tags."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from router import client as client_module
from router.client import ROUTER_ERROR_ORIGIN, CallFailed, SplitServeClient, parse_addresses, router_went_away
from router.frontend.service import ROUTER_ERROR_METADATA
from tests.unit.router.dying_router import SEED_CHOSEN, token

REPO = Path(__file__).resolve().parents[3]
PROMPT = [11, 12, 13]


class Router:
    """A stand-in router process and the calls it took."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.router.dying_router", *args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.address = f"127.0.0.1:{int(self.process.stdout.readline())}"

    def kill(self) -> None:
        self.process.kill()

    def calls(self) -> list[dict]:
        """What every call it took carried (it must have exited or be stopped first)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        return [json.loads(line) for line in self.process.stderr.read().splitlines() if line.startswith("{")]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


@pytest.fixture
def routers():
    started: list[Router] = []

    def start(*args: str) -> Router:
        started.append(Router(*args))
        return started[-1]

    yield start
    for r in started:
        r.stop()


def closed_address() -> str:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def answer(seed: int | None, n: int) -> list[int]:
    return [token(PROMPT, seed, i) for i in range(n)]


def run(addresses, kill: Router | None = None, after: int = 0, **fields):
    """The call's stream and every response; ``kill`` is killed once ``after`` responses are read."""
    with SplitServeClient(addresses) as client:
        stream = client.generate(PROMPT, **fields)
        responses = [next(stream) for _ in range(after)]
        if kill is not None:
            kill.kill()
        responses += list(stream)
    return stream, responses


def test_addresses_come_as_a_list_or_a_comma_separated_string():
    assert parse_addresses("a:1, b:2,") == ["a:1", "b:2"]
    assert parse_addresses(["a:1", "b:2"]) == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="address: no router address given"):
        parse_addresses(" , ")
    with pytest.raises(ValueError, match="address: every router address must be a non-empty string"):
        parse_addresses(["a:1", ""])
    assert ROUTER_ERROR_METADATA == (ROUTER_ERROR_ORIGIN,)


def test_a_greedy_answer_cut_mid_stream_goes_on_through_the_next_router(routers):
    dying, spare = routers("--stall-after", "3"), routers()
    stream, responses = run([dying.address, spare.address], dying, 3, max_tokens=8, temperature=0, request_id="r-1")
    assert [t for r in responses for t in r.token_ids] == answer(None, 8)
    assert "".join(r.text for r in responses) == "".join(f"<{t}>" for t in answer(None, 8))
    assert responses[-1].finish_reason == client_module.pb.FINISH_REASON_LENGTH
    assert (stream.num_resumes, stream.address) == (1, spare.address)
    assert [c["resume"] for c in dying.calls()] == [[]]
    [resumed] = spare.calls()
    assert resumed["resume"] == answer(None, 3)
    assert (resumed["request_id"], resumed["seed"]) == ("r-1", None)
    assert all(not r.HasField("seed") for r in responses)


def test_an_unseeded_sampled_answer_resumes_with_the_seed_its_first_router_chose(routers):
    dying, spare = routers("--stall-after", "2"), routers()
    stream, responses = run([dying.address, spare.address], dying, 2, max_tokens=6, temperature=0.8)
    assert [t for r in responses for t in r.token_ids] == answer(SEED_CHOSEN, 6)
    assert [r.seed for r in responses if r.HasField("seed")] == [SEED_CHOSEN]  # once, as from one router
    assert {r.request_id for r in responses} == {"fake-request-id"}
    [resumed] = spare.calls()
    assert (resumed["resume"], resumed["seed"], resumed["request_id"]) == (answer(SEED_CHOSEN, 2), SEED_CHOSEN, "fake-request-id")


def test_a_call_cut_before_its_first_message_is_simply_sent_again(routers):
    dying, spare = routers("--stall-after", "0"), routers()
    stream, responses = run([dying.address, spare.address], max_tokens=4, temperature=0.5, seed=9)
    assert [t for r in responses for t in r.token_ids] == answer(9, 4)
    assert stream.num_resumes == 0
    assert [c["resume"] for c in spare.calls()] == [[]]


def test_a_client_with_no_live_router_gets_unavailable_naming_every_address():
    first, second = closed_address(), closed_address()
    with pytest.raises(grpc.RpcError) as e:
        run(f"{first},{second}", max_tokens=4)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert e.value.details().startswith("no router could serve the call; tried ")
    assert first in e.value.details() and second in e.value.details()


def test_a_router_that_died_mid_answer_with_no_other_left_ends_the_call_unavailable(routers):
    dying = routers("--stall-after", "2")
    with SplitServeClient([dying.address, closed_address()]) as client:
        stream = client.generate(PROMPT, max_tokens=6, temperature=0)
        assert [t for r in (next(stream), next(stream)) for t in r.token_ids] == answer(None, 2)
        dying.kill()
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dying.address in e.value.details()


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE"])
def test_a_status_the_router_answers_itself_ends_the_call_without_failover(routers, code):
    refusing, spare = routers("--refuse", code), routers()
    with pytest.raises(grpc.RpcError) as e:
        run([refusing.address, spare.address], max_tokens=4)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode[code], f"router refuses: {code}")
    assert spare.calls() == []


def test_a_resume_the_next_router_cannot_verify_is_refused_not_restarted(routers, monkeypatch):
    """A client that resumes with other tokens than it received gets the router's refusal."""
    dying, spare = routers("--stall-after", "3"), routers()
    original = client_module.GenerateStream._received

    def tamper(self, response):
        response = original(self, response)
        self._token_ids[-1:] = [(self._token_ids[-1] + 1) % 1000] if len(self._token_ids) == 3 else self._token_ids[-1:]
        return response

    monkeypatch.setattr(client_module.GenerateStream, "_received", tamper)
    with pytest.raises(grpc.RpcError) as e:
        run([dying.address, spare.address], dying, 3, max_tokens=8, temperature=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("resume.tag: does not match the request and its 3 token ids")


def test_the_deadline_spans_every_router_the_call_takes(routers, monkeypatch):
    """The resume gets the time left, not a fresh timeout; with none left it is not sent."""
    clock = [1000.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    dying, spare = routers("--stall-after", "2"), routers()
    with SplitServeClient([dying.address, spare.address]) as client:
        stream = client.generate(PROMPT, max_tokens=6, temperature=0, timeout_s=100.0)
        next(stream), next(stream)
        dying.kill()
        clock[0] += 60.0
        assert [t for r in stream for t in r.token_ids] == answer(None, 6)[2:]
    [resumed] = spare.calls()
    # 40 s of the 100 were left. gRPC core may round a timeout up when it writes the grpc-timeout
    # header (a run saw 40.096 s at the server), so the bound leaves it a second; a fresh
    # timeout would be 100.
    assert 0 < resumed["time_remaining_s"] <= 41.0

    dying, spare = routers("--stall-after", "1"), routers()
    with SplitServeClient([dying.address, spare.address]) as client:
        stream = client.generate(PROMPT, max_tokens=6, temperature=0, timeout_s=100.0)
        next(stream)
        dying.kill()
        clock[0] += 100.0
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert spare.calls() == []


def test_a_cancelled_stream_does_not_fail_over(routers):
    first, spare = routers("--stall-after", "5"), routers()
    with SplitServeClient([first.address, spare.address]) as client:
        stream = client.generate(PROMPT, max_tokens=50, temperature=0)
        next(stream)
        stream.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert spare.calls() == []


def test_calls_take_turns_over_the_routers(routers):
    first, second = routers(), routers()
    with SplitServeClient([first.address, second.address]) as client:
        for _ in range(4):
            assert [t for r in client.generate(PROMPT, max_tokens=2, temperature=0) for t in r.token_ids] == answer(None, 2)
    assert (len(first.calls()), len(second.calls())) == (2, 2)


def test_unary_calls_go_to_the_first_router_that_answers(routers):
    live, dead = routers(), closed_address()
    with SplitServeClient([dead, live.address]) as client:
        assert [m.id for m in client.list_models()] == ["fake"]
    with SplitServeClient([dead, closed_address()]) as client, pytest.raises(grpc.RpcError) as e:
        client.list_models()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert e.value.details().startswith(f"no router answered; tried {dead} (")


@pytest.mark.parametrize(
    ("code", "details", "went_away"),
    [
        ("UNAVAILABLE", "Socket closed", True),
        ("UNAVAILABLE", "failed to connect to all addresses", True),
        ("UNKNOWN", "Stream removed", True),
        ("INTERNAL", "Received RST_STREAM with error code 2", True),
        ("INTERNAL", "a step raised ValueError", False),
        ("INVALID_ARGUMENT", "prompt: must not be empty", False),
        ("DEADLINE_EXCEEDED", "Deadline Exceeded", False),
        ("CANCELLED", "Locally cancelled by application!", False),
        ("RESOURCE_EXHAUSTED", "router has 512 calls in flight", False),
    ],
)
def test_which_statuses_mean_the_router_went_away(code, details, went_away):
    assert router_went_away(CallFailed(grpc.StatusCode[code], details)) is went_away
