"""bench.planner's traces: reading recorded files (Azure, BurstGPT, Mooncake, serving benchmarks' logs)
and the seeded generators that bench.planner_sets draws its named traces from.

Each generator is a shape with parameters (a Poisson rate over time, bursts at random gaps, a Markov
switch between rates, self-exciting clusters, multi-turn sessions, ...), drawn from a seed, so a set
is a list of generator calls rather than recorded constants.
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


def lognormal(rng: random.Random, median: float, sigma: float, high: int) -> int:
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
            out.append(Arrival(now, prompt(rng), lognormal(rng, output_median, 0.8, 4000)))


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
    return generate_poisson(seed + 1, rate, factor * base_rate, duration_s, lambda r: lognormal(r, 1000, 0.9, 16000))


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
    return generate_poisson(seed + 1, rate, 17.0, duration_s, lambda r: lognormal(r, 1500, prompt_sigma, 7400), output_median=output_median)


def generate_drifting(seed: int, duration_s: float, rate: float, prompt_median: Callable[[float], float], output_median: Callable[[float], float]) -> list[Arrival]:
    """Steady Poisson arrivals at ``rate`` whose prompt and answer lengths are lognormal (sigma 0.8)
    around medians that change with the arrival time: the load moves with the lengths, not the rate."""
    rng, out, now = random.Random(seed), [], 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= duration_s:
            return out
        out.append(Arrival(now, lognormal(rng, prompt_median(now), 0.8, 16000), lognormal(rng, output_median(now), 0.8, 4000)))


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
        out.append(Arrival(now, prompt(rng), lognormal(rng, output_median, 0.8, 4000)))


def merge(*traces: list[Arrival]) -> list[Arrival]:
    """The arrivals of several traces (tenants sharing a cluster) in one, in time order."""
    return sorted((a for trace in traces for a in trace), key=lambda a: a.time_s)


def generate_heavy_tail(seed: int, duration_s: float = 3600.0, rate: float = 3.0, alpha: float = 1.3, low: int = 400) -> list[Arrival]:
    """Steady Poisson arrivals with Pareto(``alpha``) prompts from ``low`` tokens up to 64k."""
    return generate_poisson(seed, lambda t: rate, rate, duration_s, lambda r: int(min(65536, low * r.paretovariate(alpha))))


def generate_diurnal(seed: int, duration_s: float = 7200.0, peak_rate: float = 8.0) -> list[Arrival]:
    """A rate rising from a tenth of ``peak_rate`` to the peak at mid-trace and back (a raised cosine)."""
    rate = lambda t: peak_rate * (0.1 + 0.9 * (1 - math.cos(2 * math.pi * t / duration_s)) / 2)  # noqa: E731
    return generate_poisson(seed, rate, peak_rate, duration_s, lambda r: lognormal(r, 900, 0.9, 16000))


def generate_flash_crowd(seed: int, duration_s: float = 3600.0, rate: float = 2.0, factor: float = 5.0, crowd_s: float = 600.0) -> list[Arrival]:
    """A steady ``rate`` that jumps to ``factor`` times it for ``crowd_s``, starting at a random time in the middle half."""
    start = random.Random(seed).uniform(duration_s / 4, 3 * duration_s / 4 - crowd_s)
    return generate_poisson(seed + 1, lambda t: rate * (factor if start <= t < start + crowd_s else 1.0), factor * rate, duration_s, lambda r: lognormal(r, 1000, 0.9, 16000))


def rescale(trace: list[Arrival], factor: float) -> list[Arrival]:
    """``trace`` with its times multiplied by ``factor`` (below 1: compressed, the rate higher)."""
    return [a._replace(time_s=a.time_s * factor) for a in trace]


def mooncake_conversations(seed: int, rate: float = 1.5, duration_s: float = 3600.0) -> list[Arrival]:
    """bench.traces' multi-turn conversations at ``rate`` req/s for ``duration_s``, as arrivals."""
    requests = generate_mooncake("multiturn", int(rate * duration_s), seed, TraceConfig(request_rate=rate))
    start = requests[0].timestamp_ms
    return [Arrival((r.timestamp_ms - start) / 1000, r.input_length, max(1, r.output_length)) for r in requests]


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
    return [Arrival(t, prompt(rng), lognormal(rng, 200.0, 0.8, 4000)) for t in sorted(times)]


def generate_sessions(seed: int, duration_s: float, session_rate: float, turns: tuple[int, int], think_s: tuple[float, float], first_prompt: float, output_median: float) -> list[Arrival]:
    """Multi-turn sessions (agents, chats) starting at ``session_rate`` per second: ``turns`` turns
    (uniform) ``think_s`` apart (uniform), each prompt the whole context so far (the last prompt, its
    answer and ~300 new tokens; the first lognormal around ``first_prompt``), at most 16k tokens."""
    rng, out, start = random.Random(seed), [], 0.0
    while (start := start + rng.expovariate(session_rate)) < duration_s:
        now, context = start, lognormal(rng, first_prompt, 0.5, 16000)
        for _ in range(rng.randint(*turns)):
            if now >= duration_s:
                break
            answer = lognormal(rng, output_median, 0.8, 4000)
            out.append(Arrival(now, context, answer))
            context = min(16000, context + answer + lognormal(rng, 300, 0.8, 4000))
            now += rng.uniform(*think_s)
    return sorted(out)


def noisy_steady(seed: int, duration_s: float = 5400.0, rate: float = 4.0, sigma: float = 0.35) -> list[Arrival]:
    """``rate`` times a lognormal factor redrawn every minute, prompts lognormal around 1k tokens."""
    rng = random.Random(seed)
    minutes = [rate * math.exp(rng.gauss(0.0, sigma)) for _ in range(int(duration_s // 60) + 1)]
    return generate_poisson(seed + 1, lambda t: minutes[int(t // 60)], max(minutes), duration_s, lambda r: lognormal(r, 1000, 0.8, 16000))
