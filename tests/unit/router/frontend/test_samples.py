"""router.frontend.samples: n samples of one request as n answers on one call."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from proto import splitserve_pb2 as pb
from router.frontend.samples import generate_samples
from router.frontend.validation import sample_seed


class FakeAnswers:
    """``generate_one`` for the fan-out: each answer streams ``num_tokens`` responses, the first
    reporting it was served by replica "decode-7" (sample 0 only calls the stream's hook)."""

    def __init__(self, num_tokens: int = 3, fail_index: int | None = None) -> None:
        self.num_tokens = num_tokens
        self.fail_index = fail_index
        self.calls: list[tuple[str, int, str | None, int]] = []
        """(request_id, seed, pinned, responses of sample 0 out when it started)."""
        self.sample0_out = 0
        self.closed: list[str] = []

    async def __call__(self, request, resume, stream, pinned):
        self.calls.append((request.request_id, request.sampling.seed, pinned, self.sample0_out))
        try:
            for i in range(self.num_tokens):
                await asyncio.sleep(0)
                if request.request_id.endswith(f".{self.fail_index}") and i == 1:
                    raise RuntimeError("worker refused")
                if i == 0 and stream.on_first_response is not None:
                    stream.on_first_response("decode-7")
                if request.request_id.endswith(".0"):
                    self.sample0_out += 1
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[i], finish_reason=pb.FINISH_REASON_LENGTH if i == self.num_tokens - 1 else 0)
        finally:
            self.closed.append(request.request_id)


def _request(seed: int = 11) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id="call", prompt_token_ids=[1, 2, 3])
    request.sampling.seed = seed
    request.sampling.temperature = 0.8
    return request


async def _collect(answers, num_samples, limit=None):
    out = []
    async with contextlib.aclosing(generate_samples(answers, _request(), num_samples, 0.0)) as responses:
        async for response in responses:
            out.append(response)
            if limit is not None and len(out) >= limit:
                break
    return out


def test_each_sample_streams_whole_under_the_call_id_with_its_index():
    answers = FakeAnswers(num_tokens=3)
    out = asyncio.run(_collect(answers, 4))
    assert sorted((r.index, tuple(r.token_ids)) for r in out) == [(i, (t,)) for i in range(4) for t in range(3)]
    assert {r.request_id for r in out} == {"call"}
    assert sum(r.finish_reason == pb.FINISH_REASON_LENGTH for r in out) == 4


def test_sample_zero_keeps_the_seed_and_the_others_derive_theirs():
    answers = FakeAnswers()
    asyncio.run(_collect(answers, 3))
    seeds = {request_id: seed for request_id, seed, _, _ in answers.calls}
    assert seeds == {"call.0": 11, "call.1": sample_seed(11, 1), "call.2": sample_seed(11, 2)}
    assert len({11, sample_seed(11, 1), sample_seed(11, 2)}) == 3


def test_the_other_samples_start_after_sample_zero_on_its_decode_replica():
    answers = FakeAnswers()
    asyncio.run(_collect(answers, 3))
    started = {request_id: (pinned, out) for request_id, _, pinned, out in answers.calls}
    assert started["call.0"] == (None, 0)
    for i in (1, 2):
        pinned, sample0_out = started[f"call.{i}"]
        assert pinned == "decode-7" and sample0_out >= 1


def test_a_failing_sample_fails_the_call_and_closes_the_others():
    answers = FakeAnswers(num_tokens=50, fail_index=1)
    with pytest.raises(RuntimeError, match="worker refused"):
        asyncio.run(_collect(answers, 3))
    assert sorted(answers.closed) == ["call.0", "call.1", "call.2"]


def test_leaving_early_closes_every_sample():
    answers = FakeAnswers(num_tokens=50)
    out = asyncio.run(_collect(answers, 3, limit=4))
    assert len(out) == 4
    assert sorted(answers.closed) == ["call.0", "call.1", "call.2"]


def test_sample_seeds_are_stable_and_distinct():
    assert sample_seed(5, 0) == 5
    seeds = [sample_seed(5, i) for i in range(16)]
    assert len(set(seeds)) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [sample_seed(5, i) for i in range(16)]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: setattr(r.sampling, "n", 17), "sampling.n"),
        (lambda r: setattr(r.sampling, "n", 0), "sampling.n"),
        (lambda r: (setattr(r.sampling, "n", 2), r.resume.token_ids.append(5)), "resume"),
        (lambda r: setattr(r.sampling, "logprobs", 21), "sampling.logprobs"),
        (lambda r: setattr(r.sampling, "prompt_logprobs", -1), "sampling.prompt_logprobs"),
        (lambda r: setattr(r, "tools_json", "[{"), "tools_json"),
        (lambda r: setattr(r, "tools_json", '{"a": 1}'), "tools_json"),
    ],
)
def test_sampling_fields_the_router_needs_right_are_refused_by_name(change, field):
    from router.config import RouterConfig
    from router.errors import CallRejected
    from router.frontend.validation import check_sampling

    request = _request()
    change(request)
    with pytest.raises(CallRejected) as e:
        check_sampling(request, RouterConfig(max_n=16))
    assert e.value.message.startswith(field)


def test_n_up_to_max_n_and_logprobs_up_to_20_pass():
    from router.config import RouterConfig
    from router.frontend.validation import check_sampling

    request = _request()
    request.sampling.n = 16
    request.sampling.logprobs = 20
    request.tools_json = '[{"type": "function", "function": {"name": "f"}}]'
    check_sampling(request, RouterConfig(max_n=16))
