"""Request traces in the Mooncake format, and a seeded generator with the structure of production traffic.

A trace is JSONL, one request a line, sorted by time:
``{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [0, 1, 46, ...]}``,
with ``timestamp`` in ms and one hash id per 512-token block of the prompt, the last one for a
partial block. Ids are chained like block keys: an equal id means an equal block *and* an equal
prefix, so a partial block's id is never shared.

The generator (``python -m bench.routing --generate KIND``) starts every prompt with one universal
prefix. ``multiturn``: chats on Zipf-popular tenants, each turn the previous prompt, its answer
and a new message (some paste a document). ``agent``: loops on Zipf-popular apps whose 6k-40k-token
tool prompt every session of the app shares, each step appending a tool call and its result.
``mixed``: half each. ``short``: many short chats (1-4 short turns). ``deep``: few long
sessions (document QA, ~20 turns) on a handful of 16k-48k-token shared documents. ``tool``: agent
loops sharing one long tool prompt, each step a short call and result. ``noisy``: ``mixed`` with
10% of its requests replaced by prompts that share nothing. Sessions start in on/off Poisson bursts from ``warmup_s`` before the trace,
which opens onto running sessions; one ``random.Random(seed)`` draws everything.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake format."""
KINDS = ("multiturn", "agent", "mixed", "short", "deep", "tool", "noisy")
DEFAULT_REQUEST_RATES = {"multiturn": 24.0, "agent": 28.0, "mixed": 22.0, "short": 40.0, "deep": 14.0, "tool": 30.0, "noisy": 14.0}
"""About half the prefill capacity of bench.routing's default 8-worker cluster under a
cache-aware policy (its ``prefill_busy_share`` ~0.4-0.5), bursts going well above."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_keys(self) -> tuple[int, ...]:
        """Ids of the prompt's full blocks: the only ones a cache can hold."""
        return self.hash_ids[: self.input_length // BLOCK_TOKENS]


class TraceLineError(ValueError):
    """A line of a trace file that is not a request; the message names the line number."""


def read_trace(path: Path) -> list[TraceRequest]:
    """A JSONL trace, sorted by timestamp (stable); TraceLineError naming the first line that is not a request."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(TraceRequest(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]), tuple(int(h) for h in row["hash_ids"])))
            except (ValueError, KeyError, TypeError) as e:
                raise TraceLineError(f"line {number} is not a request ({type(e).__name__}: {e})") from None
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def write_trace(requests: Iterable[TraceRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in requests:
            row = {"timestamp": r.timestamp_ms, "input_length": r.input_length, "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


@dataclass(frozen=True)
class TraceConfig:
    """Shape of a generated trace (sizes in tokens)."""

    request_rate: float | None = None
    """Mean requests per second (None: the kind's default in DEFAULT_REQUEST_RATES)."""
    burst_on_s: float = 30.0
    """Mean length of a burst of session starts."""
    burst_off_s: float = 30.0
    """Mean length of a quiet period between bursts."""
    off_rate_share: float = 0.2
    """Session start rate in a quiet period, as a share of the burst rate."""
    universal_prefix_tokens: int = 1200
    """The prefix every request starts with (platform preamble)."""
    num_tenants: int = 64
    """Tenants of multi-turn chat, each with its own system prompt."""
    system_prompt_tokens_median: int = 1500
    """Median tenant system prompt (lognormal, 200 to 12,000)."""
    num_agent_apps: int = 12
    """Agent apps, each with its own tool prompt."""
    tool_prompt_tokens_min: int = 6000
    """Shortest agent tool prompt (the apps' prompts are spread log-evenly up to the longest)."""
    tool_prompt_tokens_max: int = 40000
    """Longest agent tool prompt."""
    max_context_tokens: int = 131072
    """A session ends when its next prompt would be longer."""
    stream_tokens_per_s: float = 40.0
    """How fast an answer streams back (sets when the next turn or step can come)."""
    think_s_mean: float = 20.0
    """Mean time a chat user takes between an answer and the next message."""
    tool_s_mean: float = 1.5
    """Mean time an agent's tool call takes."""
    warmup_s: float = 600.0
    """Sessions start this long before the trace's first request (it opens onto a running system)."""

    def __post_init__(self) -> None:
        if (self.request_rate is not None and self.request_rate <= 0) or self.burst_on_s <= 0 or self.burst_off_s <= 0:
            raise ValueError("request_rate, burst_on_s and burst_off_s: must be > 0")
        if not 0 < self.off_rate_share <= 1:
            raise ValueError(f"off_rate_share: must be in (0, 1], got {self.off_rate_share}")
        if self.universal_prefix_tokens < BLOCK_TOKENS:
            raise ValueError(f"universal_prefix_tokens: must be >= {BLOCK_TOKENS} (one full block), got {self.universal_prefix_tokens}")
        if self.num_tenants < 1 or self.num_agent_apps < 1:
            raise ValueError("num_tenants and num_agent_apps: must be >= 1")
        if not 0 < self.tool_prompt_tokens_min <= self.tool_prompt_tokens_max:
            raise ValueError("tool_prompt_tokens_min: must be in (0, tool_prompt_tokens_max]")


@dataclass(frozen=True)
class _Prompt:
    """A prompt as the ids of its full blocks plus a token count (the tail may be partial)."""

    num_tokens: int
    full_ids: tuple[int, ...]

    def extended(self, num_tokens: int, ids: Iterator[int]) -> _Prompt:
        """This prompt and ``num_tokens`` more; blocks that fill up take fresh ids from ``ids``."""
        total = self.num_tokens + num_tokens
        return _Prompt(total, self.full_ids + tuple(itertools.islice(ids, total // BLOCK_TOKENS - len(self.full_ids))))

    def hash_ids(self, ids: Iterator[int]) -> tuple[int, ...]:
        """Mooncake hash ids: the full blocks', then a fresh one for a partial tail."""
        return self.full_ids + ((next(ids),) if self.num_tokens % BLOCK_TOKENS else ())


@dataclass(frozen=True)
class SessionStep:
    """One request of a session, ``offset_s`` after the session's first."""

    offset_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))


def _geometric(rng: random.Random, mean: float, high: int) -> int:
    return min(high, 1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / mean)))


def _zipf_weights(n: int) -> list[float]:
    return [1 / (i + 1) for i in range(n)]


class TraceGenerator:
    """Builds sessions (conversations, agent loops) and merges their requests into one trace."""

    def __init__(self, kind: str, config: TraceConfig, seed: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: {kind!r} is not one of {KINDS}")
        self.kind = kind
        self.config = config
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        universal = _Prompt(0, ()).extended(config.universal_prefix_tokens, self.ids)
        rng = self.rng
        self.tenants = [universal.extended(_lognormal(rng, config.system_prompt_tokens_median, 0.8, 200, 12000), self.ids) for _ in range(config.num_tenants)]
        n = config.num_agent_apps
        ratio = config.tool_prompt_tokens_max / config.tool_prompt_tokens_min
        lengths = [int(config.tool_prompt_tokens_min * ratio ** (i / max(1, n - 1))) for i in range(n)]
        rng.shuffle(lengths)  # popularity (Zipf by position) independent of length
        self.apps = [universal.extended(length, self.ids) for length in lengths]
        if kind == "deep":  # drawn only here, so the other kinds' traces stay as they were
            self.documents = [universal.extended(rng.randrange(16000, 48000), self.ids) for _ in range(4)]
        if kind == "tool":
            self.tool_prompt = universal.extended(12000, self.ids)

    def generate(self, num_requests: int) -> list[TraceRequest]:
        """The first ``num_requests`` requests at or after time 0 of sessions that started from
        ``-warmup_s`` on: the trace is a window onto a running system, not a cold start."""
        pilot = [self.session() for _ in range(200)]
        request_rate = self.config.request_rate or DEFAULT_REQUEST_RATES[self.kind]
        mean_rate = request_rate * len(pilot) / sum(len(s) for s in pilot)
        rows: list[tuple[int, int, int, SessionStep]] = []
        starts = self._session_starts(mean_rate)
        number = 0
        while True:
            start = next(starts)
            if len(rows) >= num_requests:
                rows.sort(key=lambda r: r[:3])
                del rows[num_requests:]
                if start * 1000 > rows[-1][0]:
                    break
            steps = pilot[number] if number < len(pilot) else self.session()
            for index, step in enumerate(steps):
                ms = round((start + step.offset_s) * 1000)
                if ms >= 0:
                    rows.append((ms, number, index, step))
            number += 1
        rows.sort(key=lambda r: r[:3])
        trace = [TraceRequest(ms, s.input_length, s.output_length, s.hash_ids) for ms, _, _, s in rows[:num_requests]]
        return self._unshared(trace, 0.1) if self.kind == "noisy" else trace

    def _unshared(self, trace: list[TraceRequest], share: float) -> list[TraceRequest]:
        """``trace`` with a ``share`` of its requests given fresh ids: prompts that share nothing."""
        chosen = set(self.rng.sample(range(len(trace)), round(share * len(trace))))
        return [
            TraceRequest(r.timestamp_ms, r.input_length, r.output_length, tuple(itertools.islice(self.ids, len(r.hash_ids)))) if i in chosen else r
            for i, r in enumerate(trace)
        ]

    def session(self) -> list[SessionStep]:
        """A session of the generator's kind (for ``mixed`` and ``noisy``, a chat or an agent loop)."""
        if self.kind == "short":
            return self.conversation(turns=_geometric(self.rng, 1.8, 4), user_median=80)
        if self.kind == "deep":
            return self.conversation(self.rng.choice(self.documents), _geometric(self.rng, 20, 60), user_median=200)
        if self.kind == "tool":
            return self.agent_loop(self.tool_prompt, result_median=150)
        agent = self.kind == "agent" or (self.kind in ("mixed", "noisy") and self.rng.random() < 0.5)
        return self.agent_loop() if agent else self.conversation()

    def conversation(self, context: _Prompt | None = None, turns: int | None = None, user_median: int = 120) -> list[SessionStep]:
        """A chat on ``context`` (a Zipf-chosen tenant's system prompt by default); each prompt is
        the previous one, its answer and a new message."""
        rng, config = self.rng, self.config
        context = context or rng.choices(self.tenants, _zipf_weights(len(self.tenants)))[0]
        steps, t = [], 0.0
        for turn in range(turns or _geometric(rng, 5, 30)):
            pasted = rng.random() < (0.25 if turn == 0 else 0.08)
            user = _lognormal(rng, 3000, 0.9, 300, 30000) if pasted else _lognormal(rng, user_median, 1.0, 5, 2000)
            prompt = context.extended(user, self.ids)
            if prompt.num_tokens > config.max_context_tokens:
                break
            answer = _lognormal(rng, 300, 0.8, 16, 2500)
            steps.append(SessionStep(t, prompt.num_tokens, answer, prompt.hash_ids(self.ids)))
            context = prompt.extended(answer, self.ids)
            t += 0.5 + answer / config.stream_tokens_per_s + rng.expovariate(1 / config.think_s_mean)
        return steps

    def agent_loop(self, app: _Prompt | None = None, result_median: int = 600) -> list[SessionStep]:
        """A loop on ``app``'s tool prompt (a Zipf-chosen app's by default); each step appends
        the last tool call and its result."""
        rng, config = self.rng, self.config
        app = app or rng.choices(self.apps, _zipf_weights(len(self.apps)))[0]
        context = app.extended(_lognormal(rng, 400, 0.8, 30, 4000), self.ids)
        steps, t = [], 0.0
        for _ in range(max(2, _geometric(rng, 10, 40))):
            if context.num_tokens > config.max_context_tokens:
                break
            call = _lognormal(rng, 120, 0.7, 10, 1000)
            steps.append(SessionStep(t, context.num_tokens, call, context.hash_ids(self.ids)))
            context = context.extended(call + _lognormal(rng, result_median, 1.0, 20, 8000), self.ids)
            t += 0.3 + call / config.stream_tokens_per_s + rng.expovariate(1 / config.tool_s_mean)
        return steps

    def _session_starts(self, mean_rate: float) -> Iterator[float]:
        """On/off Poisson session starts from ``-warmup_s``, averaging ``mean_rate`` per second."""
        rng, config = self.rng, self.config
        on_rate = mean_rate * (config.burst_on_s + config.burst_off_s) / (config.burst_on_s + config.off_rate_share * config.burst_off_s)
        t, on = -config.warmup_s, True
        while True:
            end = t + rng.expovariate(1 / (config.burst_on_s if on else config.burst_off_s))
            rate = on_rate if on else on_rate * config.off_rate_share
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    break
                yield t
            t, on = end, not on


def universal_ids(config: TraceConfig = TraceConfig()) -> tuple[int, ...]:
    """Ids of the universal prefix's full blocks (the generator allocates them first)."""
    return tuple(range(config.universal_prefix_tokens // BLOCK_TOKENS))


def generate(kind: str, num_requests: int, seed: int, config: TraceConfig = TraceConfig()) -> list[TraceRequest]:
    return TraceGenerator(kind, config, seed).generate(num_requests)


def describe(trace: Sequence[TraceRequest]) -> dict:
    """A few numbers that say what a trace is."""
    lengths = sorted(r.input_length for r in trace)
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000 if trace else 0.0
    return {
        "num_requests": len(trace),
        "span_s": span_s,
        "request_rate": len(trace) / span_s if span_s else 0.0,
        "input_length_mean": sum(lengths) / max(1, len(lengths)),
        "input_length_p50": lengths[len(lengths) // 2] if lengths else 0,
        "input_length_max": lengths[-1] if lengths else 0,
        "num_requests_32k": sum(1 for n in lengths if n >= 32768),
        "output_length_mean": sum(r.output_length for r in trace) / max(1, len(trace)),
    }

