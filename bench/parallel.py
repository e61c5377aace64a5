"""Tensor and pipeline parallelism on CPU (gloo): prefill time, decode ITL and parameter bytes per
rank at each TP size and PP x TP shape, and whether greedy output matches TP 1's.

TP 1 is a plain engine; TP N is this process as rank 0 plus N-1 Ray actor ranks. Weights and the
KV pool are fp32, and each prompt is prefilled in one step (the step budget is the longest
prompt). A prefill is timed from submission to first token with the prefix cache reset first:
the median of 3 runs up to 512 tokens, one run above. Decode ITL is the median step time once
every request of the batch has its first token. Threads per rank: the usable cores at TP 1,
cores // N (at least 1) at TP N, unless --threads sets one count for every size. Each TP size
also reports the 1-minute load average before and after it: on a shared machine, other work
shows up in every figure.

``--pp 2`` adds PP 2 at every TP size (a replica of PP x TP ranks, threads cores // ranks): each
stage's parameter and KV bytes (``param_bytes_per_stage``, ``kv_bytes_per_stage``), the decode
step time (one micro-batch landed: with a batch of B, PP micro-batches of B / PP are in flight)
and ITL (a request's time per token), and the bubble share: the part of the decode phase's wall
time the stages sat idle, 1 - (sum of the stages' busy seconds) / (stages x wall seconds).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time

from bench.report import BenchError, arg_parser, emit_report, machine, plot, positive, progress, run, user_error
from bench.workload import greedy, random_tokens, ranked_engine, start_decoding, threads_per_rank
from engine.bundled import resolve_model, served_model_name
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.build import model_len
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.parallel.pipeline import check_pp_size
from engine.parallel.sharding import check_tp_size, parameter_bytes

IDENTITY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,")
DECODE_PROMPT_TOKENS = 128
FULL = {"prompt_lengths": [512, 2048, 8000], "decode_tokens": 64, "identity_tokens": 24}
QUICK = {"prompt_lengths": [32, 128], "decode_tokens": 4, "identity_tokens": 8}


def size_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive whole numbers (``1,3``), sorted, without repeats."""
    return sorted({positive(part) for part in text.split(",")})


def prefill_s(engine: LLMEngine, prompt: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        engine.reset_prefix_cache()
        start = time.perf_counter()
        engine.generate([prompt], greedy(1))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_itl_ms(engine: LLMEngine, prompts: list[list[int]], num_tokens: int, stages: list | None = None) -> dict:
    """Median step ms and a request's ms per token of decoding ``prompts`` (each step lands one
    micro-batch: every ``pp_size`` steps each request gets a token); with ``stages`` (each
    stage's busy seconds, read now), the share of the wall time they sat idle."""
    start_decoding(engine, prompts, num_tokens)
    busy_before = stages() if stages else None
    step_s, wall = [], time.perf_counter()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    wall = time.perf_counter() - wall
    steps_per_token = len(step_s) / max(1, num_tokens - 1)
    result = {"step_ms": 1000 * statistics.median(step_s), "itl_ms": 1000 * statistics.median(step_s) * steps_per_token}
    if stages:
        busy = [after - before for before, after in zip(busy_before, stages())]
        result["bubble_share"] = 1 - sum(busy) / (len(busy) * wall)
    return result


def measure(engine: LLMEngine, followers: list, lengths: list[int], batches: list[int], sizes: dict) -> tuple[dict, list[tuple[int, ...]]]:
    """One TP size's figures and its greedy outputs of the identity prompts (the first run, so also the warm-up)."""
    import ray

    config, rng, vocab = engine.config, random.Random(0), engine.model_config.vocab_size
    shape = f"PP {config.pp_size} x TP {config.tp_size}" if config.pp_size > 1 else f"TP {config.tp_size}"
    outputs = [c.output_token_ids for c in engine.generate(list(IDENTITY_PROMPTS), greedy(sizes["identity_tokens"]))]
    result: dict = {"prefill_s": {}, "decode_itl_ms": {}}
    pipelined = config.pp_size > 1

    def stage_busy() -> list[float]:  # each stage's TP rank 0
        infos = ray.get([f.info.remote() for f in followers])
        return [engine.runner.busy_s] + [i["busy_s"] for i in infos if i["rank"] % config.tp_size == 0]

    if pipelined:
        result.update(decode_step_ms={}, bubble_share={})
    for length in lengths:
        result["prefill_s"][str(length)] = round(s := prefill_s(engine, random_tokens(rng, length, vocab), 3 if length <= 512 else 1), 4)
        progress("parallel", f"{shape} prefill {length} tokens: {s:.3f} s")
    for batch in batches:
        prompts = [random_tokens(rng, sizes["decode_prompt_tokens"], vocab) for _ in range(batch)]
        decode = decode_itl_ms(engine, prompts, sizes["decode_tokens"], stage_busy if pipelined else None)
        result["decode_itl_ms"][str(batch)] = round(decode["itl_ms"], 2)
        if pipelined:
            result["decode_step_ms"][str(batch)] = round(decode["step_ms"], 2)
            result["bubble_share"][str(batch)] = round(decode["bubble_share"], 3)
        progress("parallel", f"{shape} decode batch {batch}: {decode['itl_ms']:.1f} ms per token" + (f", bubble {decode['bubble_share']:.2f}" if pipelined else ""))
    infos = ray.get([f.info.remote() for f in followers]) if followers else []  # ray.get([]) would start a Ray
    result["param_bytes_per_rank"] = [parameter_bytes(engine.runner.model)] + [info["param_bytes"] for info in infos]
    kv_per_rank = [engine.kv_cache.buffer.numel()] + [info["kv_bytes"] for info in infos]
    result["param_bytes_per_stage"] = [sum(result["param_bytes_per_rank"][s * config.tp_size : (s + 1) * config.tp_size]) for s in range(config.pp_size)]
    result["kv_bytes_per_stage"] = [sum(kv_per_rank[s * config.tp_size : (s + 1) * config.tp_size]) for s in range(config.pp_size)]
    return result, outputs


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, plot="prefill time over prompt length and decode ITL over batch, per TP size")
    parser.add_argument("--tp", type=size_list, default=[1, 3], help="TP sizes, comma-separated; must include 1 (default: 1,3)")
    parser.add_argument("--pp", type=size_list, default=[1], help="PP sizes, comma-separated, each measured at every TP size (default: 1)")
    parser.add_argument("--prompt-lengths", type=size_list, help="prefill prompt lengths in tokens (default: 512,2048,8000)")
    parser.add_argument("--batches", type=size_list, default=[1, 16], help="decode batch sizes (default: 1,16)")
    parser.add_argument("--decode-tokens", type=positive, help=f"decode steps timed per batch (default: {FULL['decode_tokens']})")
    parser.add_argument("--threads", type=positive, help="torch threads of every rank at every TP size (default: see above)")
    parser.add_argument("--quick", action="store_true", help=f"prompts of {QUICK['prompt_lengths']} tokens and {QUICK['decode_tokens']} decode steps")
    args = parser.parse_args(argv)
    if 1 not in args.tp:
        parser.error("--tp: must include 1, the reference for token identity and parameter bytes")
    sizes = dict(QUICK if args.quick else FULL, decode_prompt_tokens=16 if args.quick else DECODE_PROMPT_TOKENS)
    lengths = args.prompt_lengths or sizes["prompt_lengths"]
    sizes["decode_tokens"] = args.decode_tokens or sizes["decode_tokens"]

    with user_error(EngineError, ValueError):  # a model that is not there, or heads that do not split
        model_config = ModelConfig.from_dir(resolve_model(args.model, None))
        for tp in args.tp:
            check_tp_size(served_model_name(args.model), model_config, tp)
        for pp in args.pp:
            check_pp_size(served_model_name(args.model), model_config, pp)
    shapes = [(pp, tp) for pp in sorted(set(args.pp) | {1}) for tp in args.tp]
    max_len = model_len(EngineConfig(model=args.model), model_config)
    if max(lengths) >= max_len:
        raise BenchError(f"--prompt-lengths: {max(lengths)} tokens and the first output token do not fit {args.model}'s context of {max_len}")
    if sizes["decode_prompt_tokens"] + sizes["decode_tokens"] >= max_len:
        raise BenchError(f"--decode-tokens: {sizes['decode_tokens']} after a {sizes['decode_prompt_tokens']}-token prompt do not fit {args.model}'s context of {max_len}")
    threads = {(pp, tp): args.threads or threads_per_rank(pp * tp) for pp, tp in shapes}
    budget = max(max(lengths), max(args.batches) * sizes["decode_prompt_tokens"])
    decode_seq_tokens, block_size = sizes["decode_prompt_tokens"] + sizes["decode_tokens"] + 1, EngineConfig.block_size
    num_blocks = 32 + max(math.ceil((max(lengths) + 1) / block_size), max(args.batches) * math.ceil(decode_seq_tokens / block_size))

    report_machine, results, outputs = machine(), {}, {}
    for pp, tp in shapes:
        name = f"pp{pp}-tp{tp}"
        progress("parallel", f"{name}: loading {args.model} over {pp * tp} rank(s), {threads[pp, tp]} torch thread(s) each")
        # fp32 weights: TP 3's tokens are checked against TP 1's, which quantized kernels (picked by
        # rows per call, and summed in another order across the ranks) do not promise.
        config = EngineConfig(model=args.model, weights="fp32", kv_dtype="fp32", tp_size=tp, pp_size=pp, max_num_batched_tokens=budget, num_kv_blocks=num_blocks)
        start, load_avg_1m = time.perf_counter(), os.getloadavg()[0]
        with ranked_engine(config, threads[pp, tp], name) as (engine, followers):
            load_s = time.perf_counter() - start
            results[pp, tp], outputs[pp, tp] = measure(engine, followers, lengths, args.batches, sizes)
        results[pp, tp].update(load_s=round(load_s, 2), threads_per_rank=threads[pp, tp], token_identical=outputs[pp, tp] == outputs[1, 1],
                               load_avg_1m=[round(load_avg_1m, 2), round(os.getloadavg()[0], 2)])
        progress("parallel", f"{name}: {results[pp, tp]['param_bytes_per_stage']} parameter bytes per stage, identical to TP 1: {results[pp, tp]['token_identical']}")

    tp_results = {tp: r for (pp, tp), r in results.items() if pp == 1}
    param_bytes = {str(tp): max(r["param_bytes_per_rank"]) for tp, r in tp_results.items()}
    report = {
        "model": args.model,
        "dtype": "float32",
        "kv_dtype": "fp32",
        "backend": "gloo",
        "prefill_step_tokens": budget,
        "decode_prompt_tokens": sizes["decode_prompt_tokens"],
        "decode_tokens": sizes["decode_tokens"],
        "identity": {"num_prompts": len(IDENTITY_PROMPTS), "num_tokens": sizes["identity_tokens"]},
        "threads": {f"pp{pp}-tp{tp}" if pp > 1 else str(tp): n for (pp, tp), n in threads.items()},
        "threads_rule": "--threads for every rank" if args.threads else "usable cores at TP 1, cores // ranks (at least 1) per rank above",
        "machine": report_machine,
        "tp": {str(tp): r for tp, r in tp_results.items()},
        "token_identical": all(r["token_identical"] for r in results.values()),
        "param_bytes_per_rank": param_bytes,
        "param_bytes_ratio_to_tp1": {tp: round(n / param_bytes["1"], 4) for tp, n in param_bytes.items()},
    }
    if len(args.pp) > 1 or args.pp != [1]:
        report["pp"] = {f"{pp}" if tp == 1 else f"{pp}x{tp}": r for (pp, tp), r in results.items() if pp > 1}
        report["param_bytes_per_stage"] = {str(pp): r["param_bytes_per_stage"] for (pp, tp), r in results.items() if tp == 1}
        report["kv_bytes_per_stage"] = {str(pp): r["kv_bytes_per_stage"] for (pp, tp), r in results.items() if tp == 1}
    emit_report(report, args.json)
    if args.plot is not None:
        plot(args.plot, f"bench.parallel: {args.model}, CPU (gloo)", [
            ("prefill (s)", "prompt tokens", {f"PP {pp} x TP {tp}": (lengths, [r["prefill_s"][str(n)] for n in lengths]) for (pp, tp), r in results.items()}),
            ("decode ITL (ms)", "batch", {f"PP {pp} x TP {tp}": (args.batches, [r["decode_itl_ms"][str(b)] for b in args.batches]) for (pp, tp), r in results.items()}),
        ], logx=True, logy=True)
    return 0


if __name__ == "__main__":
    sys.exit(run("parallel", main))
