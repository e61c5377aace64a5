"""bench.planner's traces: reading Azure and Mooncake files, and the seeded generators of the development set.

The development set (``DEV_SET``; ``python -m bench.planner_devset``) is what every planner change is
judged on at once. Its traces are made by generators whose shapes are stated relative to the
replica start-up time, so the set scales with ``--startup-s`` instead of being tuned to one value:

- ``bursts_short`` / ``bursts_equal`` / ``bursts_long``: a quiet base rate with bursts of 4x its
  rate lasting half, one and four start-up times, at random gaps;
- ``spells``: bursts of 10-17 req/s lasting one to two minutes between quiet spells of about
  1 req/s, prompts median 1.5k tokens (the shape of Azure's 2023 code service);
- ``heavy_tail``: steady Poisson arrivals whose prompts are Pareto-distributed (a share of them
  longer than any replica can prefill within the TTFT SLO);
- ``diurnal``: a rate that ramps from a tenth of its peak to the peak and back over the trace;
- ``flash_crowd``: a steady rate that jumps to 5x for ten minutes;
- ``conv_x2`` / ``conv_half``: the Azure conv trace compressed into half its time and stretched to
  twice it; ``conv``: as recorded;
- ``mooncake_conv``: bench.traces' multi-turn conversations (long prompts, sessions in on/off bursts);
- ``bursty``: the original generator (smooth bursts of long prompts, long outputs, both, quiet).
"""

from __future__ import annotations

import csv
import datetime
import gzip
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from bench.report import BenchError
from bench.traces import TraceConfig
from bench.traces import generate as generate_mooncake

CSV_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
CONV_TRACE = Path(__file__).resolve().parents[1] / "planner" / "data" / "azure_llm_2023_conv.csv.gz"

# Column names the public traces use, compared lower-cased with spaces, dashes and underscores
# dropped: Azure LLM 2023/2024 (TIMESTAMP, ContextTokens, GeneratedTokens), BurstGPT (Timestamp,
# Request tokens, Response tokens), Mooncake (timestamp in ms, input_length, output_length) and
# the names serving benchmarks log (arrival_time, prompt_tokens, completion_tokens, ...).
TIME_COLUMNS = {"timestamp": 1.0, "time": 1.0, "arrivaltime": 1.0, "arrivaltimes": 1.0, "timestamps": 1.0, "timestampms": 1e-3, "timems": 1e-3, "arrivaltimems": 1e-3}
PROMPT_COLUMNS = ("contexttokens", "inputtokens", "inputlength", "inputlen", "prompttokens", "promptlength", "promptlen", "requesttokens")
OUTPUT_COLUMNS = ("generatedtokens", "outputtokens", "outputlength", "outputlen", "completiontokens", "responsetokens")


class Arrival(NamedTuple):
    time_s: float
    prompt_tokens: int
    output_tokens: int


def _key(name: str) -> str:
    return "".join(c for c in name.strip().lstrip("\ufeff").lower() if c not in " _-")


def _columns(names: list[str], where: str) -> tuple[str, float, str, str]:
    """(time column, its unit in seconds, prompt column, output column) among ``names``, or a BenchError."""
    keys = {_key(n): n for n in names}
    time = next(((keys[k], unit) for k, unit in TIME_COLUMNS.items() if k in keys), None)
    prompt = next((keys[k] for k in PROMPT_COLUMNS if k in keys), None)
    output = next((keys[k] for k in OUTPUT_COLUMNS if k in keys), None)
    missing = [what for what, found in (("an arrival time (TIMESTAMP, arrival_time, timestamp_ms, ...)", time), ("prompt tokens (ContextTokens, input_length, prompt_tokens, Request tokens, ...)", prompt), ("output tokens (GeneratedTokens, output_length, completion_tokens, Response tokens, ...)", output)) if found is None]
    if missing:
        raise BenchError(f"{where} names no column for {' or '.join(missing)}: it has {', '.join(map(repr, names)) or 'none'}")
    return time[0], time[1], prompt, output


def _row(time: object, unit: float, prompt: object, output: object) -> tuple[float, int, int]:
    """One request, or ValueError: a time (a number in ``unit`` seconds, or an ISO 8601 date), a
    whole prompt of at least one token and a whole output of none or more (a failed request's; it
    is replayed as one token)."""
    if any(isinstance(x, bool) or not isinstance(x, (int, float, str)) for x in (time, prompt, output)):
        raise ValueError
    try:
        seconds = float(time) * unit
    except ValueError:
        seconds = datetime.datetime.fromisoformat(time).timestamp()
    prompt_tokens, output_tokens = float(prompt), float(output)
    if not math.isfinite(seconds) or not prompt_tokens.is_integer() or not output_tokens.is_integer() or prompt_tokens < 1 or output_tokens < 0:
        raise ValueError
    return seconds, int(prompt_tokens), int(output_tokens)


def read_arrivals(path: Path) -> list[Arrival]:
    """The trace at ``path`` from time 0, or a BenchError naming the first bad line.

    A CSV (or .csv.gz) with a header row, or JSON lines (.jsonl / .json, .gz too), one request a
    line. Columns are found by name (``TIME_COLUMNS``, ``PROMPT_COLUMNS``, ``OUTPUT_COLUMNS``); other
    columns are ignored. In JSON lines a bare ``timestamp`` is in milliseconds, as Mooncake writes it.
    """
    if not path.is_file():
        raise BenchError(f"--trace {path}: no such file")
    suffixes = [x.lower() for x in path.suffixes]
    try:
        with (gzip.open if suffixes[-1:] == [".gz"] else open)(path, "rt", newline="", encoding="utf-8-sig") as f:
            rows = _read_json_lines(f, path) if {".jsonl", ".json"} & set(suffixes) else _read_csv(f, path)
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise BenchError(f"--trace {path}: cannot be read ({type(e).__name__}: {e})") from None
    if len(rows) < 2:
        raise BenchError(f"--trace {path}: fewer than two requests")
    rows.sort()
    if rows[-1][0] == rows[0][0]:
        raise BenchError(f"--trace {path}: all {len(rows)} requests arrive at the same time; a replay needs their arrivals spread over time")
    start = rows[0][0]
    return [Arrival(t - start, p, max(1, o)) for t, p, o in rows]


def _read_csv(f, path: Path) -> list[tuple[float, int, int]]:
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
        raise BenchError(f"--trace {path}: empty")
    time, unit, prompt, output = _columns(header, f"--trace {path}: line 1")
    at = {name: i for i, name in enumerate(header)}
    rows = []
    for row in reader:
        if not row or not any(cell.strip() for cell in row):
            continue
        try:
            rows.append(_row(row[at[time]].strip(), unit, row[at[prompt]].strip(), row[at[output]].strip()))
        except (ValueError, IndexError, OverflowError):
            raise BenchError(f"--trace {path}: line {reader.line_num} is not a request ({time}, {prompt}, {output}): {','.join(row)!r}") from None
    return rows


def _read_json_lines(f, path: Path) -> list[tuple[float, int, int]]:
    rows, columns = [], None
    for number, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise BenchError(f"--trace {path}: line {number} is not JSON ({e})") from None
        if not isinstance(record, dict):
            raise BenchError(f"--trace {path}: line {number} is not a JSON object: {line.strip()[:80]!r}")
        if columns is None:
            columns = _columns(list(record), f"--trace {path}: line {number}")
            if _key(columns[0]) == "timestamp":
                columns = (columns[0], 1e-3, *columns[2:])  # Mooncake's timestamps are milliseconds
        time, unit, prompt, output = columns
        try:
            rows.append(_row(record[time], unit, record[prompt], record[output]))
        except (ValueError, KeyError, TypeError, OverflowError):
            raise BenchError(f"--trace {path}: line {number} is not a request ({time}, {prompt}, {output}): {line.strip()[:120]!r}") from None
    return rows


def write_csv(trace: list[Arrival], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    base = datetime.datetime(2024, 1, 1)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER)
        for a in trace:
            writer.writerow([(base + datetime.timedelta(seconds=a.time_s)).isoformat(sep=" "), a.prompt_tokens, a.output_tokens])


def _lognormal(rng: random.Random, median: float, sigma: float, high: int) -> int:
    return int(min(high, max(16, rng.lognormvariate(math.log(median), sigma))))


def generate_bursty(seed: int, duration_s: float = 3600.0, base_rate: float = 10.0) -> list[Arrival]:
    """Poisson arrivals at ``base_rate`` with Gaussian-shaped bursts (sigma 90-240 s) of long prompts
    (x4), long outputs (x4), triple rate, or a quiet spell (5% of the rate), one kind at a time."""
    rng = random.Random(seed)
    bursts, t = [], 300.0
    while t < duration_s - 300:
        width = rng.uniform(90, 240)
        bursts.append((t + 2 * width, width, rng.choice(("prompt", "output", "both", "quiet"))))
        t += 4 * width + rng.uniform(60, 300)

    def shape(now: float) -> tuple[float, float, float]:
        rate, prompt, output = 1.0, 1.0, 1.0
        for center, width, kind in bursts:
            bump = math.exp(-(((now - center) / width) ** 2) / 2)
            rate *= {"prompt": 1 + bump, "output": 1 + bump, "both": 1 + 2 * bump, "quiet": 1 - 0.95 * bump}[kind]
            prompt += 3 * bump if kind == "prompt" else 0.0
            output += 3 * bump if kind == "output" else 0.0
        return rate, prompt, output

    out, now = [], 0.0
    while True:
        now += rng.expovariate(3 * base_rate)
        if now >= duration_s:
            return out
        rate, prompt, output = shape(now)
        if rng.random() < rate / 3:
            prompt_tokens = int(min(16000, max(16, rng.lognormvariate(math.log(700), 1.0) * prompt)))
            out.append(Arrival(now, prompt_tokens, int(min(4000, max(1, rng.lognormvariate(math.log(150), 0.8) * output)))))


def generate_poisson(seed: int, rate: Callable[[float], float], peak_rate: float, duration_s: float, prompt: Callable[[random.Random], int], output_median: float = 200.0) -> list[Arrival]:
    """Arrivals of a Poisson process whose rate at time t is ``rate(t)`` (at most ``peak_rate``; thinned),
    prompts drawn by ``prompt(rng)``, outputs lognormal around ``output_median``."""
    rng, out, now = random.Random(seed), [], 0.0
    while True:
        now += rng.expovariate(peak_rate)
        if now >= duration_s:
            return out
        if rng.random() * peak_rate < rate(now):
            out.append(Arrival(now, prompt(rng), _lognormal(rng, output_median, 0.8, 4000)))


def _spells(rng: random.Random, duration_s: float, length_s: tuple[float, float], gap_s: tuple[float, float]) -> list[tuple[float, float]]:
    """(start, end) of spells of ``length_s`` between gaps of ``gap_s`` (uniform ranges), from one gap in."""
    spells, t = [], rng.uniform(*gap_s)
    while t < duration_s:
        length = rng.uniform(*length_s)
        spells.append((t, min(duration_s, t + length)))
        t += length + rng.uniform(*gap_s)
    return spells


def generate_bursts(seed: int, burst_s: float, duration_s: float = 3600.0, base_rate: float = 2.0, factor: float = 4.0) -> list[Arrival]:
    """A base rate with bursts of ``factor`` times it lasting ``burst_s`` (each 0.75-1.25x), 2-8 burst lengths
    apart (at least two minutes), prompts lognormal around 1k tokens."""
    rng = random.Random(seed)
    spells = _spells(rng, duration_s, (0.75 * burst_s, 1.25 * burst_s), (max(120.0, 2 * burst_s), max(240.0, 8 * burst_s)))
    rate = lambda t: base_rate * (factor if any(a <= t < b for a, b in spells) else 1.0)  # noqa: E731
    return generate_poisson(seed + 1, rate, factor * base_rate, duration_s, lambda r: _lognormal(r, 1000, 0.9, 16000))


def generate_code_spells(
    seed: int,
    duration_s: float = 3420.0,
    gap_s: tuple[float, float] = (120, 360),
    prompt_sigma: float = 0.7,
    output_median: float = 30.0,
    quiet_rate: float = 1.0,
) -> list[Arrival]:
    """Bursts of 10-17 req/s lasting 60-120 s between quiet spells of ``quiet_rate`` (about 1 req/s)
    lasting ``gap_s`` (2-6 minutes); prompts lognormal around 1.5k tokens (``prompt_sigma``), at most
    7.4k; short outputs."""
    rng = random.Random(seed)
    spells = [(a, b, rng.uniform(10, 17)) for a, b in _spells(rng, duration_s, (60, 120), gap_s)]
    rate = lambda t: next((r for a, b, r in spells if a <= t < b), quiet_rate)  # noqa: E731
    return generate_poisson(seed + 1, rate, 17.0, duration_s, lambda r: _lognormal(r, 1500, prompt_sigma, 7400), output_median=output_median)


def generate_drifting(seed: int, duration_s: float, rate: float, prompt_median: Callable[[float], float], output_median: Callable[[float], float]) -> list[Arrival]:
    """Steady Poisson arrivals at ``rate`` whose prompt and answer lengths are lognormal (sigma 0.8)
    around medians that change with the arrival time: the load moves with the lengths, not the rate."""
    rng, out, now = random.Random(seed), [], 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= duration_s:
            return out
        out.append(Arrival(now, _lognormal(rng, prompt_median(now), 0.8, 16000), _lognormal(rng, output_median(now), 0.8, 4000)))


def generate_random_walk(seed: int, duration_s: float, start_rate: float, sigma: float, low: float, high: float, prompt: Callable[[random.Random], int]) -> list[Arrival]:
    """Poisson arrivals whose rate walks: from ``start_rate``, its log takes a Gaussian step of
    ``sigma`` every minute, kept within [``low``, ``high``] (a load that drifts, correlated from one
    minute to the next, unlike noise redrawn each minute)."""
    rng, rates, log_rate = random.Random(seed), [], math.log(start_rate)
    for _ in range(int(duration_s // 60) + 1):
        rates.append(math.exp(log_rate))
        log_rate = min(max(log_rate + rng.gauss(0.0, sigma), math.log(low)), math.log(high))
    return generate_poisson(seed + 1, lambda t: rates[int(t // 60)], high, duration_s, prompt)


def generate_gamma(seed: int, duration_s: float, rate: float, shape: float, prompt: Callable[[random.Random], int], output_median: float = 200.0) -> list[Arrival]:
    """Arrivals at a mean ``rate`` whose gaps are Gamma(``shape``) (coefficient of variation
    1 / sqrt(shape); Poisson at 1): below 1, requests come in clumps seconds long at a steady mean,
    as BurstGPT's gaps do."""
    rng, out, now = random.Random(seed), [], 0.0
    while True:
        now += rng.gammavariate(shape, 1.0 / (shape * rate))
        if now >= duration_s:
            return out
        out.append(Arrival(now, prompt(rng), _lognormal(rng, output_median, 0.8, 4000)))


def merge(*traces: list[Arrival]) -> list[Arrival]:
    """The arrivals of several traces (tenants sharing a cluster) in one, in time order."""
    return sorted((a for trace in traces for a in trace), key=lambda a: a.time_s)


def generate_heavy_tail(seed: int, duration_s: float = 3600.0, rate: float = 3.0, alpha: float = 1.3, low: int = 400) -> list[Arrival]:
    """Steady Poisson arrivals with Pareto(``alpha``) prompts from ``low`` tokens up to 64k."""
    return generate_poisson(seed, lambda t: rate, rate, duration_s, lambda r: int(min(65536, low * r.paretovariate(alpha))))


def generate_diurnal(seed: int, duration_s: float = 7200.0, peak_rate: float = 8.0) -> list[Arrival]:
    """A rate rising from a tenth of ``peak_rate`` to the peak at mid-trace and back (a raised cosine)."""
    rate = lambda t: peak_rate * (0.1 + 0.9 * (1 - math.cos(2 * math.pi * t / duration_s)) / 2)  # noqa: E731
    return generate_poisson(seed, rate, peak_rate, duration_s, lambda r: _lognormal(r, 900, 0.9, 16000))


def generate_flash_crowd(seed: int, duration_s: float = 3600.0, rate: float = 2.0, factor: float = 5.0, crowd_s: float = 600.0) -> list[Arrival]:
    """A steady ``rate`` that jumps to ``factor`` times it for ``crowd_s``, starting at a random time in the middle half."""
    start = random.Random(seed).uniform(duration_s / 4, 3 * duration_s / 4 - crowd_s)
    return generate_poisson(seed + 1, lambda t: rate * (factor if start <= t < start + crowd_s else 1.0), factor * rate, duration_s, lambda r: _lognormal(r, 1000, 0.9, 16000))


def rescale(trace: list[Arrival], factor: float) -> list[Arrival]:
    """``trace`` with its times multiplied by ``factor`` (below 1: compressed, the rate higher)."""
    return [a._replace(time_s=a.time_s * factor) for a in trace]


def mooncake_conversations(seed: int, rate: float = 1.5, duration_s: float = 3600.0) -> list[Arrival]:
    """bench.traces' multi-turn conversations at ``rate`` req/s for ``duration_s``, as arrivals."""
    requests = generate_mooncake("multiturn", int(rate * duration_s), seed, TraceConfig(request_rate=rate))
    start = requests[0].timestamp_ms
    return [Arrival((r.timestamp_ms - start) / 1000, r.input_length, max(1, r.output_length)) for r in requests]


def dev_set(startup_s: float = 60.0, seed_offset: int = 0) -> dict[str, Callable[[], list[Arrival]]]:
    """The development traces by name, each a thunk (bursts are sized from ``startup_s``). A
    ``seed_offset`` draws every generated trace from other seeds: the same shapes, traces the planner
    was not developed on (the recorded conv traces stay as they are)."""
    k = seed_offset
    return {
        "bursts_short": lambda: generate_bursts(11 + k, startup_s / 2),
        "bursts_equal": lambda: generate_bursts(12 + k, startup_s),
        "bursts_long": lambda: generate_bursts(13 + k, 4 * startup_s),
        "spells": lambda: generate_code_spells(14 + k),
        "heavy_tail": lambda: generate_heavy_tail(15 + k),
        "diurnal": lambda: generate_diurnal(16 + k),
        "flash_crowd": lambda: generate_flash_crowd(17 + k),
        "conv": lambda: read_arrivals(CONV_TRACE),
        "conv_x2": lambda: rescale(read_arrivals(CONV_TRACE), 0.5),
        "conv_half": lambda: rescale(read_arrivals(CONV_TRACE), 2.0),
        "mooncake_conv": lambda: mooncake_conversations(18 + k),
        "bursty_0": lambda: generate_bursty(0 + k),
        "bursty_7": lambda: generate_bursty(7 + k),
    }


def outside_set(startup_s: float = 60.0, seed_offset: int = 0) -> dict[str, Callable[[], list[Arrival]]]:
    """Shapes the planner was not developed on, kept apart as a check (``bench.planner_devset --set
    outside``): never tuned on, only reported."""
    k = seed_offset
    prompt = lambda r: _lognormal(r, 1200, 0.8, 16000)  # noqa: E731
    longer = lambda r: _lognormal(r, 1400, 0.9, 16000)  # noqa: E731
    return {
        # A steady 6 req/s after 40 idle minutes: the warm-up is over and the pools at their least when it comes.
        "idle_then_load": lambda: generate_poisson(101 + k, lambda t: 0.0 if t < 2400 else 6.0, 6.0, 4200.0, prompt),
        # A rate climbing from 1 to 10 req/s over ten minutes, then dropping back, six times.
        "sawtooth": lambda: generate_poisson(102 + k, lambda t: 1 + 9 * (t % 600) / 600, 10.0, 3600.0, prompt),
        # 12 req/s for 20 minutes, then 2.
        "step_down": lambda: generate_poisson(103 + k, lambda t: 12.0 if t < 1200 else 2.0, 12.0, 3600.0, prompt),
        # Short prompts and answers of about 1,500 tokens: the decode pool carries the load.
        "long_answers": lambda: generate_poisson(104 + k, lambda t: 2.0, 2.0, 3600.0, lambda r: _lognormal(r, 200, 0.5, 2000), output_median=1500.0),
        # One request every 50 s.
        "trickle": lambda: generate_poisson(105 + k, lambda t: 0.02, 0.02, 3600.0, prompt),
        # 12 req/s for two start-ups in every six, 2 req/s between.
        "periodic": lambda: generate_poisson(106 + k, lambda t: 12.0 if t % (6 * startup_s) < 2 * startup_s else 2.0, 12.0, 3600.0, prompt),
        # Added 2026-11-29, after the level rule was settled: longer prompts (median 1,400 tokens).
        # Two crowds at 4x for 12 minutes, 20 minutes apart: a level that comes back within the window.
        "double_crowd": lambda: generate_poisson(201 + k, lambda t: 12.0 if (1500 <= t < 2220 or 3420 <= t < 4140) else 3.0, 12.0, 5400.0, longer),
        # Three crowds at 4x for 8 minutes, 10 minutes apart.
        "crowd_train": lambda: generate_poisson(202 + k, lambda t: 10.0 if any(a <= t < a + 480 for a in (1200, 2280, 3360)) else 2.5, 10.0, 4800.0, longer),
        # 3x for 40 minutes, then back.
        "plateau": lambda: generate_poisson(203 + k, lambda t: 9.0 if 1200 <= t < 3600 else 3.0, 9.0, 5400.0, longer),
        # A step from 3 to 8 req/s at 30 minutes and back at 70, with 40-second bursts at 2.5x every 7 minutes.
        "steps_and_bursts": lambda: generate_poisson(204 + k, lambda t: (8.0 if 1800 <= t < 4200 else 3.0) * (2.5 if t % 420 < 40 else 1.0), 20.0, 5400.0, longer),
        # A climb from 2 to 9 req/s over an hour.
        "slow_climb": lambda: generate_poisson(205 + k, lambda t: 2.0 + 7.0 * t / 3600, 9.0, 3600.0, longer),
        # Added 2026-11-29 (third session), drawn before the trend-bet rule was judged.
        # 2 to 12 req/s and back over 30 minutes, twice: two peaks a window apart.
        "ramp_twice": lambda: generate_poisson(301 + k, lambda t: 2 + 10 * (1 - abs(t % 1800 - 900) / 900), 12.0, 3600.0, prompt),
        # 12 req/s for three minutes at 5, 15 and 25 minutes, 3 between: bursts inside the warm-up.
        "warmup_bursts": lambda: generate_poisson(302 + k, lambda t: 12.0 if any(a <= t < a + 180 for a in (300, 900, 1500)) else 3.0, 12.0, 3600.0, prompt),
        # 1 req/s for 30 minutes, then a climb to 8 over ten minutes, held.
        "morning": lambda: generate_poisson(303 + k, lambda t: 1.0 if t < 1800 else min(8.0, 1.0 + 7.0 * (t - 1800) / 600), 8.0, 4200.0, prompt),
        # As the Azure code trace reads: 10-17 req/s for 1-2 minutes between 2-5 quiet minutes
        # at 1 req/s; prompts spread wider than "spells"' (lognormal sigma 1, at most 7.4k tokens).
        "code_like": lambda: generate_code_spells(304 + k, 3600.0, gap_s=(120, 300), prompt_sigma=1.0, output_median=200.0),
        # About 4 req/s, the rate redrawn every minute (lognormal, sigma 0.35), for 90 minutes.
        "noisy_steady": lambda: noisy_steady(305 + k),
        # Added 2026-11-29 (fourth session), drawn before any replay of them.
        # The code trace by its own figures (8,819 requests in 57 minutes, about 2.6 req/s):
        # 1-2 minute bursts of 10-17 req/s between 4-8 quiet minutes at 0.3 req/s.
        "code_sparse": lambda: generate_code_spells(401 + k, 3420.0, gap_s=(240, 480), quiet_rate=0.3),
        # 2 req/s with a 90-second spike to 16 every 20 minutes: spikes shorter than two start-ups.
        "spikes": lambda: generate_poisson(402 + k, lambda t: 16.0 if t % 1200 >= 1110 else 2.0, 16.0, 3600.0, prompt),
        # A steady 4 req/s whose prompts' median grows from 600 to 3,000 tokens over the hour.
        "prompt_drift": lambda: generate_drifting(403 + k, 3600.0, 4.0, lambda t: 600 + 2400 * t / 3600, lambda t: 200),
        # 3 req/s whose answers run 1,500 tokens (median) for five minutes in every fifteen, 150 between.
        "answer_bursts": lambda: generate_drifting(404 + k, 3600.0, 3.0, lambda t: 1000, lambda t: 1500 if t % 900 < 300 else 150),
        # Added 2026-11-30 (tenth session), drawn before any replay of them.
        # A launch: 14 req/s halving every 10 minutes, down to 1.5.
        "decay": lambda: generate_poisson(501 + k, lambda t: max(1.5, 14.0 * 0.5 ** (t / 600)), 14.0, 3600.0, prompt),
        # A rate that walks for 90 minutes from 4 req/s (log steps of sigma 0.15 a minute, 0.5 to 14).
        "random_walk": lambda: generate_random_walk(502 + k, 5400.0, 4.0, 0.15, 0.5, 14.0, prompt),
        # 2 req/s and 8 req/s, half an hour each, twice: a level that comes back once the window has let it go.
        "square_30": lambda: generate_poisson(503 + k, lambda t: 8.0 if (t // 1800) % 2 else 2.0, 8.0, 7200.0, prompt),
        # An upstream outage: 4 req/s, none for two minutes in every fifteen, then a retry storm at 12 for one.
        "retry_storm": lambda: generate_poisson(504 + k, lambda t: 0.0 if 600 <= t % 900 < 720 else (12.0 if 720 <= t % 900 < 780 else 4.0), 12.0, 3600.0, prompt),
        # A crowd of chatters: 2 req/s whose answers run 1,200 tokens (median) for 12 minutes from minute 35, 150 otherwise.
        "chatty_crowd": lambda: generate_drifting(505 + k, 3600.0, 2.0, lambda t: 800, lambda t: 1200 if 2100 <= t < 2820 else 150),
        # Long-context retrieval: prompts of 8k tokens (median, up to 32k) at 1 req/s, then 2 from minute 30.
        "long_context": lambda: generate_poisson(506 + k, lambda t: 1.0 if t < 1800 else 2.0, 2.0, 3600.0, lambda r: _lognormal(r, 8000, 0.5, 32000)),
        # Added 2026-11-30 (eleventh session), drawn before any replay of them.
        # 4 req/s on average, in clumps: Gamma gaps of shape 0.25 (a coefficient of variation of 2).
        "clumped": lambda: generate_gamma(601 + k, 3600.0, 4.0, 0.25, prompt),
        # Two tenants: chat all hour (3 req/s, 300-token prompts, 400-token answers) and, from minute
        # 35 for 15 minutes, a document job (2 req/s of 4k-token prompts, 50-token answers).
        "tenant_mix": lambda: merge(
            generate_poisson(602 + k, lambda t: 3.0, 3.0, 3600.0, lambda r: _lognormal(r, 300, 0.6, 4000), output_median=400.0),
            generate_poisson(612 + k, lambda t: 2.0 if 2100 <= t < 3000 else 0.0, 2.0, 3600.0, lambda r: _lognormal(r, 4000, 0.4, 16000), output_median=50.0),
        ),
        # A rate swinging between 2 and 8 req/s with a 20-minute period, for 90 minutes.
        "sine_20": lambda: generate_poisson(603 + k, lambda t: 5.0 - 3.0 * math.cos(2 * math.pi * t / 1200), 8.0, 5400.0, prompt),
        # 3 req/s for 45 minutes, then 6 to the end of 90.
        "late_step": lambda: generate_poisson(604 + k, lambda t: 3.0 if t < 2700 else 6.0, 6.0, 5400.0, prompt),
        # 3 req/s, and every 10 minutes a batch job's 30 requests of 12k-token prompts within a minute.
        "doc_batches": lambda: merge(
            generate_poisson(605 + k, lambda t: 3.0, 3.0, 3600.0, prompt),
            generate_poisson(615 + k, lambda t: 0.5 if t % 600 >= 540 else 0.0, 0.5, 3600.0, lambda r: _lognormal(r, 12000, 0.2, 16000), output_median=100.0),
        ),
        # Added 2026-11-30 (twelfth session), drawn before any replay of them.
        # A rate switching between 2 and 7 req/s at random, staying 6 minutes on average, for 90 minutes.
        "switching": lambda: generate_switching(701 + k, 5400.0, (2.0, 7.0), 360.0, prompt),
        # Self-exciting arrivals: 1.5 req/s of users, each request drawing 0.6 more within ~20 s (3.75 req/s).
        "hawkes": lambda: generate_hawkes(702 + k, 3600.0, 1.5, 0.6, 20.0, prompt),
        # Agents: 0.12 sessions/s of 4-12 turns 3-20 s apart, each prompt the context so far (1.5k tokens first).
        "agent_sessions": lambda: generate_sessions(703 + k, 3600.0, 0.12, (4, 12), (3.0, 20.0), 1500.0, 300.0),
        # 8 req/s falling to 2 at minute 30 and back to 8 at 60: the warm-up's peak, come back.
        "v_shape": lambda: generate_poisson(704 + k, lambda t: 2.0 + 6.0 * abs(t - 1800.0) / 1800.0, 8.0, 3600.0, prompt),
        # Many small requests: 15 req/s (±3 over 40 minutes) of 150-token prompts and 120-token answers.
        "small_fast": lambda: generate_poisson(705 + k, lambda t: 15.0 + 3.0 * math.sin(2 * math.pi * t / 2400), 18.0, 3600.0, lambda r: _lognormal(r, 150, 0.6, 2000), output_median=120.0),
        # Added 2026-11-30 (fifteenth session), drawn before any replay of them: levels that last
        # about the window (half an hour) or longer, and come back.
        # 2 req/s and 8 req/s, an hour each, twice: a level that comes back an hour after it ended.
        "square_60": lambda: generate_poisson(801 + k, lambda t: 8.0 if (t // 3600) % 2 else 2.0, 8.0, 14400.0, prompt),
        # 7 req/s for 40 minutes, then 2 for 20, three times: a long level with short breaks.
        "long_on": lambda: generate_poisson(802 + k, lambda t: 7.0 if t % 3600 < 2400 else 2.0, 7.0, 10800.0, prompt),
        # 8 req/s for 20 minutes, then 2 for 40, three times: a level back after the window let it go.
        "long_off": lambda: generate_poisson(803 + k, lambda t: 8.0 if t % 3600 < 1200 else 2.0, 8.0, 10800.0, prompt),
        # A rate swinging between 1.5 and 9 req/s with a 90-minute period, for three hours.
        "sine_90": lambda: generate_poisson(804 + k, lambda t: 5.25 - 3.75 * math.cos(2 * math.pi * t / 5400), 9.0, 10800.0, prompt),
    }


def generate_switching(seed: int, duration_s: float, rates: tuple[float, ...], sojourn_s: float, prompt: Callable[[random.Random], int]) -> list[Arrival]:
    """A Markov-modulated Poisson process: the rate is one of ``rates`` and moves to another of them,
    at random, after exponential sojourns of mean ``sojourn_s`` (steps at times no schedule gives)."""
    rng, changes, now = random.Random(seed), [], 0.0
    state = rng.randrange(len(rates))
    while now < duration_s:
        changes.append((now, rates[state]))
        now += rng.expovariate(1.0 / sojourn_s)
        state = rng.choice([i for i in range(len(rates)) if i != state])
    rate = lambda t: next(r for start, r in reversed(changes) if start <= t)  # noqa: E731
    return generate_poisson(seed + 1, rate, max(rates), duration_s, prompt)


def generate_hawkes(seed: int, duration_s: float, background: float, branching: float, decay_s: float, prompt: Callable[[random.Random], int]) -> list[Arrival]:
    """Self-exciting arrivals (a Hawkes process, drawn as clusters): requests at ``background`` req/s,
    each of which brings a Poisson(``branching``) number more at exponential delays of mean ``decay_s``,
    and so on; the mean rate is ``background / (1 - branching)``."""
    rng, times, now = random.Random(seed), [], 0.0
    while (now := now + rng.expovariate(background)) < duration_s:
        times.append(now)
    parents = list(times)
    while parents:
        parent = parents.pop()
        children, limit, product = 0, math.exp(-branching), rng.random()
        while product > limit:  # Knuth's Poisson draw
            children, product = children + 1, product * rng.random()
        for _ in range(children):
            if (child := parent + rng.expovariate(1.0 / decay_s)) < duration_s:
                times.append(child)
                parents.append(child)
    return [Arrival(t, prompt(rng), _lognormal(rng, 200.0, 0.8, 4000)) for t in sorted(times)]


def generate_sessions(seed: int, duration_s: float, session_rate: float, turns: tuple[int, int], think_s: tuple[float, float], first_prompt: float, output_median: float) -> list[Arrival]:
    """Multi-turn sessions (agents, chats) starting at ``session_rate`` per second: ``turns`` turns
    (uniform) ``think_s`` apart (uniform), each prompt the whole context so far (the last prompt, its
    answer and ~300 new tokens; the first lognormal around ``first_prompt``), at most 16k tokens."""
    rng, out, start = random.Random(seed), [], 0.0
    while (start := start + rng.expovariate(session_rate)) < duration_s:
        now, context = start, _lognormal(rng, first_prompt, 0.5, 16000)
        for _ in range(rng.randint(*turns)):
            if now >= duration_s:
                break
            answer = _lognormal(rng, output_median, 0.8, 4000)
            out.append(Arrival(now, context, answer))
            context = min(16000, context + answer + _lognormal(rng, 300, 0.8, 4000))
            now += rng.uniform(*think_s)
    return sorted(out)


def noisy_steady(seed: int, duration_s: float = 5400.0, rate: float = 4.0, sigma: float = 0.35) -> list[Arrival]:
    """``rate`` times a lognormal factor redrawn every minute, prompts lognormal around 1k tokens."""
    rng = random.Random(seed)
    minutes = [rate * math.exp(rng.gauss(0.0, sigma)) for _ in range(int(duration_s // 60) + 1)]
    return generate_poisson(seed + 1, lambda t: minutes[int(t // 60)], max(minutes), duration_s, lambda r: _lognormal(r, 1000, 0.8, 16000))


SETS = {"dev": dev_set, "outside": outside_set}
"""``bench.planner_devset --set``: the development set, or the shapes kept apart as a check."""
RECORDED = frozenset({"conv", "conv_x2", "conv_half"})
"""The traces read from a recording: every seed draws the same one."""


def draw(trace_set: str, name: str, startup_s: float = 60.0, seed_offset: int = 0, scale: int = 1) -> list[Arrival]:
    """Trace ``name`` of ``SETS[trace_set]``; at ``scale`` K the K draws of seed offsets
    ``seed_offset + 1000 i`` superposed: the same shape at K times the load, from K times the users."""
    if scale < 1:
        raise BenchError(f"scale must be at least 1, got {scale}")
    if scale > 1 and name in RECORDED:
        raise BenchError(f"{name} is a recorded trace: every seed draws the same one, so it cannot be scaled by superposing draws")
    return merge(*(SETS[trace_set](startup_s, seed_offset + 1000 * i)[name]() for i in range(scale)))
