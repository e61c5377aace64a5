"""The planner's named trace sets: the development set, the outside shapes and ``draw``.

The development set (``dev_set``; ``python -m bench.planner_devset``) is what every planner change is
judged on at once. Its traces are made by bench.planner_traces' generators, with shapes stated
relative to the replica start-up time, so the set scales with ``--startup-s`` instead of being tuned
to one value:

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

The outside set (``outside_set``; ``--set outside``) holds shapes the planner was not developed on,
each drawn and committed before any replay of it, kept apart as a check.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bench.planner_traces import (
    CONV_TRACE,
    Arrival,
    generate_bursts,
    generate_bursty,
    generate_code_spells,
    generate_diurnal,
    generate_drifting,
    generate_flash_crowd,
    generate_gamma,
    generate_hawkes,
    generate_heavy_tail,
    generate_poisson,
    generate_random_walk,
    generate_sessions,
    generate_switching,
    lognormal,
    merge,
    mooncake_conversations,
    noisy_steady,
    read_arrivals,
    rescale,
)
from bench.report import BenchError


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
    prompt = lambda r: lognormal(r, 1200, 0.8, 16000)  # noqa: E731
    longer = lambda r: lognormal(r, 1400, 0.9, 16000)  # noqa: E731
    return {
        # A steady 6 req/s after 40 idle minutes: the warm-up is over and the pools at their least when it comes.
        "idle_then_load": lambda: generate_poisson(101 + k, lambda t: 0.0 if t < 2400 else 6.0, 6.0, 4200.0, prompt),
        # A rate climbing from 1 to 10 req/s over ten minutes, then dropping back, six times.
        "sawtooth": lambda: generate_poisson(102 + k, lambda t: 1 + 9 * (t % 600) / 600, 10.0, 3600.0, prompt),
        # 12 req/s for 20 minutes, then 2.
        "step_down": lambda: generate_poisson(103 + k, lambda t: 12.0 if t < 1200 else 2.0, 12.0, 3600.0, prompt),
        # Short prompts and answers of about 1,500 tokens: the decode pool carries the load.
        "long_answers": lambda: generate_poisson(104 + k, lambda t: 2.0, 2.0, 3600.0, lambda r: lognormal(r, 200, 0.5, 2000), output_median=1500.0),
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
        "long_context": lambda: generate_poisson(506 + k, lambda t: 1.0 if t < 1800 else 2.0, 2.0, 3600.0, lambda r: lognormal(r, 8000, 0.5, 32000)),
        # Added 2026-11-30 (eleventh session), drawn before any replay of them.
        # 4 req/s on average, in clumps: Gamma gaps of shape 0.25 (a coefficient of variation of 2).
        "clumped": lambda: generate_gamma(601 + k, 3600.0, 4.0, 0.25, prompt),
        # Two tenants: chat all hour (3 req/s, 300-token prompts, 400-token answers) and, from minute
        # 35 for 15 minutes, a document job (2 req/s of 4k-token prompts, 50-token answers).
        "tenant_mix": lambda: merge(
            generate_poisson(602 + k, lambda t: 3.0, 3.0, 3600.0, lambda r: lognormal(r, 300, 0.6, 4000), output_median=400.0),
            generate_poisson(612 + k, lambda t: 2.0 if 2100 <= t < 3000 else 0.0, 2.0, 3600.0, lambda r: lognormal(r, 4000, 0.4, 16000), output_median=50.0),
        ),
        # A rate swinging between 2 and 8 req/s with a 20-minute period, for 90 minutes.
        "sine_20": lambda: generate_poisson(603 + k, lambda t: 5.0 - 3.0 * math.cos(2 * math.pi * t / 1200), 8.0, 5400.0, prompt),
        # 3 req/s for 45 minutes, then 6 to the end of 90.
        "late_step": lambda: generate_poisson(604 + k, lambda t: 3.0 if t < 2700 else 6.0, 6.0, 5400.0, prompt),
        # 3 req/s, and every 10 minutes a batch job's 30 requests of 12k-token prompts within a minute.
        "doc_batches": lambda: merge(
            generate_poisson(605 + k, lambda t: 3.0, 3.0, 3600.0, prompt),
            generate_poisson(615 + k, lambda t: 0.5 if t % 600 >= 540 else 0.0, 0.5, 3600.0, lambda r: lognormal(r, 12000, 0.2, 16000), output_median=100.0),
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
        "small_fast": lambda: generate_poisson(705 + k, lambda t: 15.0 + 3.0 * math.sin(2 * math.pi * t / 2400), 18.0, 3600.0, lambda r: lognormal(r, 150, 0.6, 2000), output_median=120.0),
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


SETS = {"dev": dev_set, "outside": outside_set}
"""``bench.planner_devset --set``: the development set, or the shapes kept apart as a check."""
RECORDED = frozenset({"conv", "conv_x2", "conv_half"})
"""The traces read from a recording: every seed draws the same one."""


def chosen(trace_set: str, names: list[str] | None, scale: int = 1) -> list[str]:
    """The traces of ``SETS[trace_set]`` a bench replays: ``names``, or by default all of them (less
    the recorded ones at a ``scale`` over 1). Raises ValueError naming any not in the set, or any
    recorded one asked for at a scale over 1."""
    in_set = list(SETS[trace_set]())
    names = names or [name for name in in_set if scale == 1 or name not in RECORDED]
    if stray := [name for name in names if name not in in_set]:
        raise ValueError(f"--traces {' '.join(stray)}: not in --set {trace_set} ({', '.join(in_set)})")
    if scale > 1 and (recorded := [name for name in names if name in RECORDED]):
        raise ValueError(f"--traces {' '.join(recorded)}: recorded traces, which --scale cannot superpose (every seed draws the same one)")
    return names


def draw(trace_set: str, name: str, startup_s: float = 60.0, seed_offset: int = 0, scale: int = 1) -> list[Arrival]:
    """Trace ``name`` of ``SETS[trace_set]``; at ``scale`` K the K draws of seed offsets
    ``seed_offset + 1000 i`` superposed: the same shape at K times the load, from K times the users."""
    if scale < 1:
        raise BenchError(f"scale must be at least 1, got {scale}")
    if scale > 1 and name in RECORDED:
        raise BenchError(f"{name} is a recorded trace: every seed draws the same one, so it cannot be scaled by superposing draws")
    return merge(*(SETS[trace_set](startup_s, seed_offset + 1000 * i)[name]() for i in range(scale)))
