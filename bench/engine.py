"""Engine throughput and TTFT: splitserve's engine against transformers' ``generate``, one run.

Both get the same seeded requests at each concurrency N. splitserve runs a closed loop of
``LLMEngine.step()``, the next request joining when one finishes; transformers runs static
batches of N left-padded prompts, each lasting as long as its longest output, and counts only
each request's own tokens. TTFT runs from handing a request over to its first token.
"""

from __future__ import annotations

import sys
import time

import torch

from bench.report import BenchError, arg_parser, check_ranges, emit_report, machine, percentile, plot, positive, progress, run, series
from bench.workload import BenchRequest, greedy, random_workload
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine

SYSTEMS = ("splitserve", "transformers")


def run_splitserve(engine: LLMEngine, workload: list[BenchRequest], concurrency: int) -> dict:
    engine.reset_prefix_cache()  # every run starts cold, as transformers does
    queue = list(enumerate(workload))
    submitted: dict[str, float] = {}
    ttfts: list[float] = []
    in_flight: set[str] = set()
    num_output = 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency:
            index, req = queue.pop(0)
            rid = f"bench-{concurrency}-{index}"
            engine.add_request(rid, list(req.prompt_token_ids), greedy(req.num_output_tokens))
            submitted[rid] = time.perf_counter()
            in_flight.add(rid)
        for out in engine.step():
            if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
                ttfts.append(time.perf_counter() - submitted[out.request_id])
            num_output += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)
    wall_s = time.perf_counter() - start
    return _result("splitserve", concurrency, num_output, wall_s, ttfts)


class _FirstTokenTimer:
    """A transformers streamer that records when generate emits each put; the first is the prompt."""

    def __init__(self) -> None:
        self.put_s: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.put_s.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(model, workload: list[BenchRequest], concurrency: int, pad_token_id: int) -> dict:
    ttfts: list[float] = []
    num_output = 0
    start = time.perf_counter()
    for first in range(0, len(workload), concurrency):
        batch = workload[first : first + concurrency]
        prompts = [list(r.prompt_token_ids) for r in batch]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        max_new = max(r.num_output_tokens for r in batch)
        timer = _FirstTokenTimer()
        batch_start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, eos_token_id=None, pad_token_id=pad_token_id, streamer=timer)
        ttfts += [timer.put_s[1] - batch_start] * len(batch)
        num_output += sum(r.num_output_tokens for r in batch)
    wall_s = time.perf_counter() - start
    return _result("transformers", concurrency, num_output, wall_s, ttfts)


def _result(system: str, concurrency: int, num_output: int, wall_s: float, ttfts: list[float]) -> dict:
    return {
        "system": system,
        "concurrency": concurrency,
        "output_tok_per_s": round(num_output / wall_s, 2),
        "ttft_s_p50": round(percentile(ttfts, 50), 4),
        "ttft_s_p99": round(percentile(ttfts, 99), 4),
        "num_output_tokens": num_output,
        "wall_s": round(wall_s, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, plot="tok/s and TTFT p50 against concurrency")
    parser.add_argument("--num-requests", type=positive, default=64)
    parser.add_argument("--concurrency", type=positive, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=positive, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=positive, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-dtype", default=EngineConfig.kv_dtype, choices=["fp32", "bf16", "fp8_e4m3"])
    parser.add_argument("--kv-cache-bytes", type=positive, default=4 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)
    check_ranges(parser, args, "prompt_len", "output_len")

    import transformers

    progress("engine", f"loading {args.model}")
    try:
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, kv_cache_bytes=args.kv_cache_bytes))
    except (EngineError, ValueError) as e:  # a model that is not there or not servable, a pool too small
        raise BenchError(str(e)) from None
    if args.prompt_len[1] + args.output_len[1] > engine.max_model_len:
        raise BenchError(f"--prompt-len MAX + --output-len MAX exceeds {args.model}'s {engine.max_model_len} tokens")
    workload = random_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), engine.model_config.vocab_size, args.seed)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(engine.checkpoint_dir, dtype=getattr(torch, args.dtype)).eval()
    pad = engine.model_config.eos_token_ids[0] if engine.model_config.eos_token_ids else 0

    progress("engine", "warming up both systems")
    warmup = [BenchRequest(r.prompt_token_ids, 4) for r in workload[:2]]
    run_splitserve(engine, warmup, 2)
    run_transformers(hf_model, warmup, 2, pad)

    runners = {"splitserve": lambda n: run_splitserve(engine, workload, n), "transformers": lambda n: run_transformers(hf_model, workload, n, pad)}
    results = []
    for concurrency in args.concurrency:
        for system in args.systems:
            results.append(r := runners[system](concurrency))
            progress("engine", f"{system} N={concurrency}: {r['output_tok_per_s']} tok/s, TTFT p50 {r['ttft_s_p50']} s")
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "machine": machine(),
        "results": results,
        "speedup": _speedups(results),
    }
    emit_report(report, args.json)
    if args.plot is not None:
        plot(args.plot, f"bench.engine: {args.model}, {args.num_requests} requests", [
            ("output tok/s", "concurrency", series(results, "output_tok_per_s", lambda r: r["system"])),
            ("TTFT p50 (s)", "concurrency", series(results, "ttft_s_p50", lambda r: r["system"])),
        ], logx=True)
    return 0


def _speedups(results: list[dict]) -> dict[str, float]:
    by = {(r["system"], r["concurrency"]): r["output_tok_per_s"] for r in results}
    return {str(c): round(by[("splitserve", c)] / by[("transformers", c)], 3) for (s, c) in by if s == "splitserve" and ("transformers", c) in by}


if __name__ == "__main__":
    sys.exit(run("engine", main))
