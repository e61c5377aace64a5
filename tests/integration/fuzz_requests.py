"""What test_fuzz_api sends and what it expects back: hypothesis strategies that build public
API requests field by field, and an oracle that knows which fields of a request the server must
refuse (from the fuzz cluster's limits, below, and the model's own tokenizer).

Each field is mostly valid and now and then extreme, so about half the requests are served and
the other half are refused for one or two named reasons.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
from hypothesis import strategies as st

from engine.tokenizer import Tokenizer
from proto import splitserve_pb2 as pb

VOCAB = 512
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 6  # 96 tokens, less than the context: a long enough request cannot fit the pool
MAX_MODEL_LEN = 128
MAX_PROMPT_CHARS = 20_000
MAX_PROMPT_TOKEN_IDS = 4096
MAX_GRPC_MESSAGE_BYTES = 4 * 1024 * 1024  # grpc's default receive limit
DEFAULT_MAX_TOKENS = 16
SERVED = "SERVED"
"""A model name the oracle replaces with the served model's (strategies run before the cluster)."""

chars = st.characters(exclude_categories=("Cs",))  # protobuf strings are UTF-8: no lone surrogates
any_text = st.text(chars, max_size=40)
short_text = st.text(chars, min_size=1, max_size=12)
huge_text = st.builds(lambda ch, n: ch * n, chars, st.sampled_from([MAX_PROMPT_CHARS, MAX_PROMPT_CHARS + 1, 300_000, 2_200_000]))
int32s = st.integers(-(2**31), 2**31 - 1)
int64s = st.integers(-(2**63), 2**63 - 1)
extreme_floats = st.one_of(
    st.floats(width=32),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-40, 1e-6, 1.0000001, 3.4e38, math.inf, -math.inf, math.nan]),
)
extreme_token_ids = st.one_of(st.integers(-3, VOCAB + 3), int32s)
model_names = st.one_of(st.sampled_from(["", SERVED]), any_text)


def mostly(valid, extreme, unset: bool = True):
    """One value in twelve is ``extreme``; the rest are ``valid`` or, with ``unset``, None."""
    def choose(i: int):
        if i == 0:
            return extreme
        return st.none() if unset and i <= 4 else valid
    return st.integers(0, 11).flatmap(choose)


def chat_messages(cheap: bool = False):
    valid = st.lists(st.tuples(st.one_of(st.sampled_from(["user", "assistant", "system"]), short_text), any_text), min_size=1, max_size=3)
    role = st.one_of(st.sampled_from(["user", ""]), any_text)
    extreme = st.one_of(
        st.lists(st.tuples(role, any_text if cheap else st.one_of(any_text, huge_text)), max_size=4),
        st.builds(lambda m, n: [m] * n, st.tuples(role, any_text), st.sampled_from([50, 500])),
    )
    return mostly(valid, extreme, unset=False)


def prompt_token_ids(cheap: bool = False):
    valid = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60)
    extreme = st.lists(extreme_token_ids, max_size=8)
    if not cheap:
        extreme = st.one_of(extreme, st.builds(lambda t, n: [t] * n, extreme_token_ids, st.sampled_from([MAX_MODEL_LEN, MAX_PROMPT_TOKEN_IDS + 1])))
    return mostly(valid, extreme, unset=False)


@st.composite
def generate_requests(draw, cheap: bool = False) -> pb.GenerateRequest:
    """A GenerateRequest built field by field; ``cheap`` leaves out values of many kilobytes."""
    r = pb.GenerateRequest(model=draw(mostly(st.sampled_from(["", SERVED]), model_names, unset=False)))
    one_source = st.sampled_from([("prompt",), ("prompt_token_ids",), ("messages",)])
    sources = draw(mostly(one_source, st.sets(st.sampled_from(["prompt", "prompt_token_ids", "messages"])), unset=False))
    if "prompt" in sources:
        r.prompt = draw(mostly(any_text, st.just("") if cheap else st.one_of(st.just(""), huge_text), unset=False))
    if "prompt_token_ids" in sources:
        r.prompt_token_ids.extend(draw(prompt_token_ids(cheap)))
    if "messages" in sources:
        for role, content in draw(chat_messages(cheap)):
            r.messages.add(role=role, content=content)
    if (t := draw(mostly(st.floats(0, 5, width=32), extreme_floats))) is not None:
        r.sampling.temperature = t
    if (p := draw(mostly(st.floats(0, 1, exclude_min=True, width=32), extreme_floats))) is not None:
        r.sampling.top_p = p
    if (k := draw(mostly(st.integers(0, 50), int32s))) is not None:
        r.sampling.top_k = k
    if (seed := draw(mostly(int64s, st.sampled_from([-(2**63), -1, 2**63 - 1])))) is not None:
        r.sampling.seed = seed
    if (m := draw(mostly(st.integers(1, 8), st.one_of(st.integers(-2, 0), int32s)))) is not None:
        r.stop.max_tokens = m
    r.stop.stop.extend(draw(mostly(st.lists(short_text, max_size=3), st.lists(st.one_of(st.just(""), any_text), max_size=3), unset=False)))
    r.stop.stop_token_ids.extend(draw(mostly(st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(extreme_token_ids, max_size=3), unset=False)))
    r.stop.ignore_eos = draw(st.booleans())
    weird_ids = st.one_of(any_text, st.sampled_from(["dup\x00", "\U0010ffff" * 256, "x" * 257]))
    r.request_id = draw(mostly(st.sampled_from(["", "", "", "dup"]), weird_ids, unset=False))
    r.tenant_salt = draw(mostly(st.sampled_from(["", "tenant-a"]), any_text, unset=False))
    return r


@st.composite
def valid_generate_requests(draw) -> pb.GenerateRequest:
    """A short request with every field valid (the concurrency test's usual request)."""
    r = pb.GenerateRequest(model=draw(st.sampled_from(["", SERVED])), tenant_salt=draw(st.sampled_from(["", "tenant-a"])))
    if draw(st.booleans()):
        r.prompt = draw(st.text(st.characters(max_codepoint=0x7F, exclude_categories=("Cs",)), min_size=1, max_size=40))
    else:
        r.prompt_token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)))
    if (t := draw(st.one_of(st.none(), st.floats(0, 2, width=32)))) is not None:
        r.sampling.temperature = t
    if (seed := draw(st.one_of(st.none(), int64s))) is not None:
        r.sampling.seed = seed
    if (m := draw(st.one_of(st.none(), st.integers(1, 8)))) is not None:
        r.stop.max_tokens = m
    r.stop.ignore_eos = draw(st.booleans())
    return r


@st.composite
def huge_generate_requests(draw) -> pb.GenerateRequest:
    """A request with one or two fields of kilobytes to megabytes (some past grpc's limit)."""
    r = draw(generate_requests(cheap=True))
    fields = ["prompt", "prompt_token_ids", "messages", "role", "stop", "stop_token_ids", "tenant_salt", "request_id", "model"]
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True)):
        n = draw(st.sampled_from([1000, 100_000, 1_100_000]))
        if field == "prompt":
            _keep_source(r, "prompt")
            r.prompt = draw(huge_text)
        elif field == "prompt_token_ids":
            _keep_source(r, "prompt_token_ids")
            r.prompt_token_ids[:] = [draw(extreme_token_ids)] * n
        elif field == "messages":
            _keep_source(r, "messages")
            r.messages.extend([pb.ChatMessage(role="user", content=draw(any_text))] * min(n, 100_000))
        elif field == "role":
            _keep_source(r, "messages")
            r.messages.add(role=draw(chars) * n, content="hi")
        elif field == "stop":
            r.stop.stop[:] = [draw(short_text)] * min(n, 100_000)
        elif field == "stop_token_ids":
            r.stop.stop_token_ids[:] = [draw(extreme_token_ids)] * n
        else:
            setattr(r, field, draw(chars) * n * 4)
    return r


def _keep_source(r: pb.GenerateRequest, source: str) -> None:
    for name in ("prompt", "prompt_token_ids", "messages"):
        if name != source:
            r.ClearField(name)


@st.composite
def tokenize_requests(draw) -> pb.TokenizeRequest:
    r = pb.TokenizeRequest(model=draw(mostly(st.sampled_from(["", SERVED]), model_names, unset=False)))
    sources = draw(mostly(st.sampled_from([("prompt",), ("messages",)]), st.sets(st.sampled_from(["prompt", "messages"])), unset=False))
    if "prompt" in sources:
        r.prompt = draw(mostly(any_text, huge_text, unset=False))
    if "messages" in sources:
        for role, content in draw(chat_messages()):
            r.messages.add(role=role, content=content)
    if (add := draw(st.one_of(st.none(), st.booleans()))) is not None:
        r.add_special_tokens = add
    return r


@st.composite
def raw_tokenize_requests(draw) -> bytes:
    """Random bytes, or a small TokenizeRequest's bytes with one of them changed."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=48))
    request = draw(tokenize_requests())
    if request.model == SERVED or len(request.prompt) > 100 or len(request.messages) > 3:
        request = pb.TokenizeRequest(prompt=draw(any_text))
    data = bytearray(request.SerializeToString())
    if data:
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@st.composite
def raw_requests(draw) -> bytes:
    """Bytes sent as a serialized GenerateRequest: random; a small request's bytes with a few
    changed, cut or inserted; two requests concatenated (protobuf merges them: fields combine,
    the last scalar wins); or a request followed by a field number it does not have."""
    kind = draw(st.sampled_from(["random", "mutated", "mutated", "merged", "unknown field"]))
    if kind == "random":
        return draw(st.binary(max_size=64))
    data = bytearray(_serialized(draw(generate_requests(cheap=True))))
    if kind == "merged":
        return bytes(data) + _serialized(draw(generate_requests(cheap=True)))
    if kind == "unknown field":
        number = draw(st.integers(9, 2**29 - 1))
        if draw(st.booleans()):
            return bytes(data) + _varint(number << 3) + _varint(draw(st.integers(0, 2**64 - 1)))
        payload = draw(st.binary(max_size=32))
        return bytes(data) + _varint(number << 3 | 2) + _varint(len(payload)) + payload
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["change", "cut", "insert"]))
        if op == "change" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=6))
    return bytes(data)


def _serialized(request: pb.GenerateRequest) -> bytes:
    if request.model == SERVED:
        request.model = ""
    return request.SerializeToString()


@dataclass
class Outcome:
    """How a call ended: its status, the status message and the responses streamed before."""

    code: grpc.StatusCode
    details: str = ""
    responses: tuple[pb.GenerateResponse, ...] = ()
    duration_s: float = 0.0

    @property
    def label(self) -> str:
        return self.code.name

    @property
    def field(self) -> str:
        """The field an INVALID_ARGUMENT message starts with ("max_tokens: must be ...")."""
        return self.details.split(":", 1)[0]


class Oracle:
    """Which fields of a request the server must refuse, and what a served request must look like."""

    def __init__(self, tokenizer: Tokenizer, served_model: str) -> None:
        self.tokenizer = tokenizer
        self.served_model = served_model

    def fix_model(self, request) -> None:
        if request.model == SERVED:
            request.model = self.served_model

    def judge_generate(self, r: pb.GenerateRequest, outcome: Outcome) -> None:
        if r.ByteSize() > MAX_GRPC_MESSAGE_BYTES:
            assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in outcome.details, outcome
            return
        bad, ids = self._generate_bad_fields(r)
        if bad:
            assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT and outcome.field in bad, (bad, outcome)
            return
        assert outcome.code == grpc.StatusCode.OK, outcome
        *middle, last = outcome.responses
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in middle) and last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        output_ids = [t for response in outcome.responses for t in response.token_ids]
        max_tokens = r.stop.max_tokens if r.stop.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        assert last.usage.prompt_tokens == len(ids) and last.usage.completion_tokens == len(output_ids) >= 1
        assert len(output_ids) <= max_tokens and all(t < VOCAB for t in output_ids)
        if last.finish_reason == pb.FINISH_REASON_LENGTH:
            assert len(output_ids) == min(max_tokens, MAX_MODEL_LEN - len(ids))
        if r.request_id:
            assert {response.request_id for response in outcome.responses} == {r.request_id}

    def judge_tokenize(self, r: pb.TokenizeRequest, outcome: Outcome, token_ids: list[int]) -> None:
        if r.ByteSize() > MAX_GRPC_MESSAGE_BYTES:
            assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in outcome.details, outcome
            return
        sources = [n for n, present in (("prompt", r.HasField("prompt")), ("messages", bool(r.messages))) if present]
        bad = self._common_bad_fields(r, sources)
        if bad:
            assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT and outcome.field in bad, (bad, outcome)
            return
        assert outcome.code == grpc.StatusCode.OK, outcome
        if r.messages:
            assert token_ids == self._chat_token_ids(r.messages)
        else:
            assert token_ids == self.tokenizer.encode(r.prompt, add_special_tokens=r.add_special_tokens if r.HasField("add_special_tokens") else True)

    def _common_bad_fields(self, r, sources: list[str]) -> set[str]:
        bad = set()
        if r.model and r.model != self.served_model:
            bad.add("model")
        if len(r.prompt) + sum(len(m.role) + len(m.content) for m in r.messages) > MAX_PROMPT_CHARS:
            bad.add("prompt" if r.prompt else "messages")
        if len(sources) != 1:
            bad.add(sources[0] if sources else "prompt")
        return bad

    def _generate_bad_fields(self, r: pb.GenerateRequest) -> tuple[set[str], list[int] | None]:
        """The fields the server may name (any one of them), and the prompt's token ids when none."""
        sources = [n for n, present in (("prompt", r.HasField("prompt")), ("prompt_token_ids", bool(r.prompt_token_ids)), ("messages", bool(r.messages))) if present]
        bad = self._common_bad_fields(r, sources)
        if len(r.prompt_token_ids) > MAX_PROMPT_TOKEN_IDS:
            bad.add("prompt_token_ids")
        bad |= {f"messages[{i}].role" for i, m in enumerate(r.messages) if not m.role}
        if len(r.request_id) > 256:
            bad.add("request_id")
        s, stop = r.sampling, r.stop
        checks = {
            "temperature": s.HasField("temperature") and not s.temperature >= 0,
            "top_p": s.HasField("top_p") and not 0 < s.top_p <= 1,
            "top_k": s.HasField("top_k") and s.top_k < 0,
            "max_tokens": stop.HasField("max_tokens") and stop.max_tokens < 1,
            "stop": any(not x for x in stop.stop),
            "stop_token_ids": any(t < 0 for t in stop.stop_token_ids),
        }
        router_checked = not bad  # the router's own checks passed: it refuses a too-long prompt next
        bad |= {name for name, failed in checks.items() if failed}
        if bad:
            if router_checked and sources == ["prompt_token_ids"] and len(r.prompt_token_ids) >= MAX_MODEL_LEN:
                bad.add("prompt")  # refused before routing, ahead of the engine's sampling checks
            return bad, None
        ids = self._prompt_token_ids(r)
        if not ids or any(not 0 <= t < VOCAB for t in ids) or len(ids) >= MAX_MODEL_LEN:
            return {"prompt", sources[0]}, None  # the engine names its own argument, "prompt"
        max_tokens = stop.max_tokens if stop.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if -(-min(len(ids) + max_tokens, MAX_MODEL_LEN) // BLOCK_SIZE) > NUM_KV_BLOCKS:
            return {"max_tokens"}, None
        return set(), ids

    def _prompt_token_ids(self, r: pb.GenerateRequest) -> list[int]:
        if r.HasField("prompt"):
            return self.tokenizer.encode(r.prompt)
        if r.prompt_token_ids:
            return list(r.prompt_token_ids)
        return self._chat_token_ids(r.messages)

    def _chat_token_ids(self, messages) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
        return self.tokenizer.encode(text, add_special_tokens=False)
