"""Engine throughput and TTFT: splitserve's engine against transformers' ``generate``, one run.

    python -m bench.engine --model smollm2-135m --json OUT

Both systems get the same seeded requests (random prompt tokens, exact output lengths) at each
concurrency. splitserve runs a closed loop: N requests in flight, the next one submitted as soon
as one finishes. transformers runs static batches of N left-padded prompts; a batch lasts as
long as its longest output, and only each request's own tokens are counted. TTFT is measured
from the moment a request is handed to the system to its first output token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench.workload import BenchRequest, emit_report, percentile, random_workload
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams

NUM_SPECIAL_TOKENS = 32
"""Prompt token ids start above this, clear of SmolLM2's control tokens (ids 0-16)."""


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
            params = SamplingParams(max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True)
            engine.add_request(rid, list(req.prompt_token_ids), params)
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
    """A transformers streamer that records when generate emits its first new token."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_s: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:  # the first put is the prompt itself
            self.first_token_s = time.perf_counter()

    def end(self) -> None:
        pass


def run_transformers(model, workload: list[BenchRequest], concurrency: int, pad_token_id: int) -> dict:
    ttfts: list[float] = []
    num_output = 0
    start = time.perf_counter()
    for first in range(0, len(workload), concurrency):
        batch = workload[first : first + concurrency]
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            input_ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            attention_mask[row, width - len(r.prompt_token_ids) :] = 1
        max_new = max(r.num_output_tokens for r in batch)
        timer = _FirstTokenTimer()
        batch_start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_token_id,
                streamer=timer,
            )
        ttfts += [timer.first_token_s - batch_start] * len(batch)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path, help="write the results here as well as to stdout")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-dtype", default=EngineConfig.kv_dtype, choices=["fp32", "bf16", "fp8_e4m3"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", default=["splitserve", "transformers"])
    args = parser.parse_args(argv)

    import transformers

    config = EngineConfig(model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, kv_cache_bytes=4 << 30)
    engine = LLMEngine(config)
    workload = random_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), engine.model_config.vocab_size, NUM_SPECIAL_TOKENS, args.seed
    )
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        engine.checkpoint_dir, dtype=getattr(torch, args.dtype)
    ).eval()
    pad = engine.model_config.eos_token_ids[0] if engine.model_config.eos_token_ids else 0

    warmup = workload[:2]
    run_splitserve(engine, [BenchRequest(r.prompt_token_ids, 4) for r in warmup], 2)
    run_transformers(hf_model, [BenchRequest(r.prompt_token_ids, 4) for r in warmup], 2, pad)

    results = []
    for concurrency in args.concurrency:
        if "splitserve" in args.systems:
            results.append(run_splitserve(engine, workload, concurrency))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        if "transformers" in args.systems:
            results.append(run_transformers(hf_model, workload, concurrency, pad))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "torch_threads": torch.get_num_threads(),
        "results": results,
        "speedup": _speedups(results),
    }
    emit_report(report, args.json)
    return 0


def _speedups(results: list[dict]) -> dict[str, float]:
    by = {(r["system"], r["concurrency"]): r["output_tok_per_s"] for r in results}
    return {
        str(c): round(by[("splitserve", c)] / by[("transformers", c)], 3)
        for (system, c) in by
        if system == "splitserve" and ("transformers", c) in by
    }


if __name__ == "__main__":
    sys.exit(main())
