"""What the CPU attention kernels (engine/kernels/_cpu_attention.c) save per decode step, against the torch path.

One engine decodes ``--concurrency`` requests of a ``--prompt-len``-token prompt for
``--tokens`` tokens; its steps alternate between the C kernels and the torch path (gather +
SDPA, torch's FP8 requantization), so both modes run the same context lengths under the same
load from anything else on the machine: a paired comparison, robust on a shared box. Each row
is one run: mean and median ms per decode step of each mode.

    python -m bench.cpu_attention --kv-dtype fp8_e4m3 --prompt-len 32 --concurrency 1 --threads 2
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.report import BenchError, arg_parser, emit_report, machine, positive, progress, run
from bench.workload import greedy
from engine.config import EngineConfig
from engine.kernels import cpu_attention
from engine.llm_engine import LLMEngine
from kv_store.keys import KV_DTYPES

MODES = ("torch", "native")


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp8_e4m3", help="KV pool dtype (default: fp8_e4m3)")
    parser.add_argument("--prompt-len", type=positive, default=32, help="prompt tokens per request (default: 32)")
    parser.add_argument("--concurrency", type=positive, default=1, help="requests decoded together (default: 1)")
    parser.add_argument("--tokens", type=positive, default=128, help="output tokens per request (default: 128)")
    parser.add_argument("--repeats", type=positive, default=3, help="runs (default: 3)")
    parser.add_argument("--threads", type=positive, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if not cpu_attention.NATIVE_ATTENTION:
        raise BenchError("engine.kernels._cpu_attention is not built: run `python setup.py build_ext --inplace` (needs gcc)")
    if args.threads:
        torch.set_num_threads(args.threads)
    progress("cpu_attention", f"loading {args.model}")
    engine = LLMEngine(EngineConfig(model=args.model, weights="native", kv_dtype=args.kv_dtype))
    _decode(engine, args, 8)  # warm-up
    rows = []
    for repeat in range(args.repeats):
        progress("cpu_attention", f"run {repeat + 1} of {args.repeats}")
        rows.append(_decode(engine, args, args.tokens))
    settings = {name: getattr(args, name) for name in ("kv_dtype", "prompt_len", "concurrency", "tokens")}
    report = {"bench": "cpu_attention", "model": args.model, "machine": machine(), **settings, "runs": rows}
    emit_report(report, args.json)
    return 0


def _decode(engine: LLMEngine, args, num_tokens: int) -> dict:
    """One run: every request prefilled, then decode steps alternating between the two modes."""
    vocab = engine.model_config.vocab_size
    for i in range(args.concurrency):
        prompt = [(1000 + i * 7919 + j * 31) % vocab for j in range(args.prompt_len)]
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, greedy(num_tokens))
    started: set[str] = set()
    while len(started) < args.concurrency:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    step_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        while engine.has_unfinished_requests():
            mode = MODES[sum(map(len, step_s.values())) % 2]
            cpu_attention.NATIVE_ATTENTION = mode == "native"
            start = time.perf_counter()
            engine.step()
            step_s[mode].append(time.perf_counter() - start)
    finally:
        cpu_attention.NATIVE_ATTENTION = True
    return {
        f"{mode}_ms_per_step": {"mean": round(statistics.mean(s) * 1e3, 2), "median": round(statistics.median(s) * 1e3, 2), "steps": len(s)}
        for mode, s in step_s.items()
        if s
    }


if __name__ == "__main__":
    raise SystemExit(run("cpu_attention", main))
