"""Engine throughput and TTFT: splitserve's engine against llama.cpp and transformers' ``generate``, one run.

Every system gets the same seeded token ids at each concurrency N. splitserve runs a closed loop
of ``LLMEngine.step()``, the next request joining when one finishes; llama.cpp (on the very GGUF
file splitserve loads, with torch's thread count) runs the same closed loop with its own
continuous batching (``bench/llama_cpp_peer.py``); transformers runs static batches of N
left-padded prompts, each lasting as long as its longest output, and counts only each request's
own tokens. TTFT runs from handing a request over to its first token. Besides the sweep, each
system prefills one 512-token prompt (prompt tok/s) and decodes 128 tokens alone (decode tok/s,
the first token's step left out).

``--device cuda`` runs splitserve (dense bf16 or fp32 weights, decode attention in the Triton
kernel) and transformers on the GPU, and adds ``roofline``: per concurrency, the median decode
step against the HBM bandwidth it would need, (bytes of weights + bytes of KV read per step) /
step time, as a fraction of the GPU's spec-sheet peak and of a device copy measured in the run.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from bench.llama_cpp_peer import LlamaCppPeer, import_llama_cpp
from bench.report import BenchError, arg_parser, check_ranges, emit_report, machine, median_s, percentile, plot, positive, progress, run, series, user_error
from bench.spec import add_spec_arguments, spec_report
from bench.workload import BenchRequest, closed_loop, greedy, random_tokens, random_workload, start_decoding
from engine.bundled import bundled_model, bundled_model_names
from engine.config import ACT_PLANES, WEIGHT_FORMATS, EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine

SYSTEMS = ("splitserve", "transformers", "llama.cpp")
DECODE_PROBE_PROMPT_LEN = 32
"""Prompt tokens of the decode tok/s probe (its output length is ``--probe-len``'s second number)."""
VOCAB_PROBE_TEXT = "<|im_start|>user\nThe quick brown fox, 1234 émigrés & <tags>:\tsplitserve's  tokens vs llama.cpp's.<|im_end|>"
"""Tokenized both ways before llama.cpp is fed splitserve's token ids: the two vocabularies must agree."""


@dataclass(frozen=True)
class System:
    """One system under test: its sweep at a concurrency, and its two single-stream probes."""

    serve: Callable[[list[BenchRequest], int], dict]
    """workload, concurrency -> one ``results`` row."""
    prefill: Callable[[list[int]], None]
    """Prefill prompt token ids into an empty cache and sample the first token."""
    decode_s: Callable[[list[int], int], float]
    """prompt token ids, output tokens -> seconds from the first output token to the last."""


def run_splitserve(engine: LLMEngine, workload: list[BenchRequest], concurrency: int) -> dict:
    engine.reset_prefix_cache()  # every run starts cold, as transformers does
    submitted: dict[str, float] = {}
    ttfts: list[float] = []

    def add(index: int) -> str:
        rid = f"bench-{concurrency}-{index}"
        req = workload[index]
        engine.add_request(rid, list(req.prompt_token_ids), greedy(req.num_output_tokens))
        submitted[rid] = time.perf_counter()
        return rid

    def on_output(out) -> None:
        if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
            ttfts.append(time.perf_counter() - submitted[out.request_id])

    num_output, wall_s = closed_loop(engine, len(workload), concurrency, add, on_output)
    return _result("splitserve", concurrency, num_output, wall_s, ttfts)


def splitserve_prefill(engine: LLMEngine, prompt: list[int]) -> None:
    engine.reset_prefix_cache()
    engine.add_request(f"prompt-probe-{time.monotonic_ns()}", prompt, greedy(1))
    while engine.has_unfinished_requests():
        engine.step()


def splitserve_decode_s(engine: LLMEngine, prompt: list[int], num_output_tokens: int) -> float:
    engine.add_request(f"decode-probe-{time.monotonic_ns()}", prompt, greedy(num_output_tokens))
    while not any(out.new_token_ids for out in engine.step()):
        pass
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


class _FirstTokenTimer:
    """A transformers streamer that records when generate emits each put; the first is the prompt."""

    def __init__(self) -> None:
        self.put_s: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.put_s.append(time.perf_counter())

    def end(self) -> None:
        pass


def roofline_rows(engine: LLMEngine, concurrency: list[int], context: int, num_steps: int, peak: float | None, copy_bw: float) -> list[dict]:
    """Per concurrency N: N sequences of ``context`` prompt tokens decode ``num_steps`` steps
    together; the median step's tok/s and the HBM bytes/s it implies (every weight read once,
    every sequence's KV read once per step) against ``peak`` and ``copy_bw``."""
    model, layout = engine.runner.model, engine.kv_cache.layout
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied LM head is yielded once
    if not model.config.tie_word_embeddings:  # a lookup reads a row per token, not the table
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    token_bytes, scale_bytes = layout.payload_bytes / layout.block_size, layout.scale_bytes
    vocab, rows = engine.model_config.vocab_size, []
    for n in concurrency:
        progress("engine", f"roofline: {n} sequences of {context} tokens, {num_steps} decode steps")
        engine.reset_prefix_cache()
        start_decoding(engine, [[(1000 + i * 7919 + j * 31) % vocab for j in range(context)] for i in range(n)], num_steps)
        step_s = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()  # ends in sampling, which reads the tokens back: the GPU has finished the step
            step_s.append(time.perf_counter() - start)
        median = statistics.median(step_s)
        mid = context + 1 + len(step_s) // 2  # tokens each sequence attends over in the middle step (they move in lockstep)
        moved = weight_bytes + n * (mid * token_bytes + -(-mid // layout.block_size) * scale_bytes)
        row = {"concurrency": n, "context": context, "ms_per_step": round(median * 1e3, 3), "tok_per_s": round(n / median, 1),
               "weight_bytes": weight_bytes, "kv_bytes_per_step": round(moved - weight_bytes), "gb_per_s": round(moved / median / 1e9, 1),
               "fraction_of_copy": round(moved / median / copy_bw, 3)}
        if peak:
            row["fraction_of_hbm_peak"] = round(moved / median / peak, 3)
        rows.append(row)
    return rows


def run_transformers(model, workload: list[BenchRequest], concurrency: int, pad_token_id: int) -> dict:
    ttfts: list[float] = []
    num_output = 0
    start = time.perf_counter()
    for first in range(0, len(workload), concurrency):
        batch = workload[first : first + concurrency]
        prompts = [list(r.prompt_token_ids) for r in batch]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts], device=model.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
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


def transformers_prefill(model, prompt: list[int]) -> None:
    with torch.inference_mode():
        model(torch.tensor([prompt], device=model.device), logits_to_keep=1)  # as generate's prefill: the last position's logits only
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def transformers_decode_s(model, prompt: list[int], num_output_tokens: int, pad_token_id: int) -> float:
    timer = _FirstTokenTimer()
    with torch.inference_mode():
        model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=num_output_tokens, min_new_tokens=num_output_tokens,
                       do_sample=False, eos_token_id=None, pad_token_id=pad_token_id, streamer=timer)
    return timer.put_s[-1] - timer.put_s[1]  # put 0 is the prompt, put 1 the first token


def run_llama_cpp(peer: LlamaCppPeer, workload: list[BenchRequest], concurrency: int) -> dict:
    served = peer.serve(workload, concurrency)
    return _result("llama.cpp", concurrency, served.num_output_tokens, served.wall_s, served.ttfts_s)


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
    args = _parse_args(argv)
    if "llama.cpp" in args.systems:
        import_llama_cpp()  # before minutes of loading: say now that it is missing
    torch.set_num_threads(args.threads)
    progress("engine", f"loading {args.model} (weights {args.weights}, {args.threads} threads)")
    with user_error(EngineError, ValueError):  # a model that is not there or not servable, a pool too small
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, weights=args.weights, act_planes=args.act_planes,
                                        kv_dtype=args.kv_dtype, kv_cache_bytes=args.kv_cache_bytes, device=args.device))
    longest = max(args.prompt_len[1] + args.output_len[1], args.probe_len[0] + 1, DECODE_PROBE_PROMPT_LEN + args.probe_len[1])
    if longest > engine.max_model_len:
        raise BenchError(f"--prompt-len MAX + --output-len MAX ({longest} with the probes) exceeds {args.model}'s {engine.max_model_len} tokens")
    vocab_size = engine.model_config.vocab_size
    workload = random_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size, args.seed)
    peer = _llama_cpp_peer(args, engine, max(args.concurrency), longest) if "llama.cpp" in args.systems else None
    try:
        systems = _systems(args, engine, peer, workload)
        report = _measure(args, systems, workload, vocab_size)
    finally:
        if peer is not None:
            peer.close()
    if peer is not None:
        report["llama_cpp"] = peer.describe()
    if args.device == "cuda":
        from bench.kernels import copy_bytes_per_s, peak_hbm_bytes_per_s

        peak, copy_bw = peak_hbm_bytes_per_s(torch.cuda.get_device_name()), copy_bytes_per_s()
        report.update(device=torch.cuda.get_device_name(), hbm_peak_gb_per_s=peak and peak / 1e9, copy_gb_per_s=round(copy_bw / 1e9, 1))
        report["roofline"] = roofline_rows(engine, args.concurrency, args.roofline_context, args.probe_len[1], peak, copy_bw)
    if args.spec != "off":
        args.spec_method = args.spec
        report.update(spec_report(args, lambda **overrides: LLMEngine(EngineConfig(
            model=args.model, dtype=args.dtype, weights=args.weights, act_planes=args.act_planes, kv_dtype=args.kv_dtype,
            kv_cache_bytes=args.kv_cache_bytes, **overrides))))
    emit_report(report, args.json)
    if args.plot is not None:
        results = report["results"]
        plot(args.plot, f"bench.engine: {args.model}, {args.num_requests} requests, weights {args.weights}", [
            ("output tok/s", "concurrency", series(results, "output_tok_per_s", lambda r: r["system"])),
            ("TTFT p50 (s)", "concurrency", series(results, "ttft_s_p50", lambda r: r["system"])),
        ], logx=True)
    return 0


def _parse_args(argv: list[str] | None):
    parser = arg_parser(__doc__, plot="tok/s and TTFT p50 against concurrency")
    parser.add_argument("--num-requests", type=positive, default=32)
    parser.add_argument("--concurrency", type=positive, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=positive, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=positive, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weights", default=EngineConfig.weights, choices=WEIGHT_FORMATS, help="splitserve's linear-layer weights (EngineConfig.weights)")
    parser.add_argument("--act-planes", type=int, default=EngineConfig.act_planes, choices=ACT_PLANES,
                        help="int8 planes of activations in the quantized kernel: 2, or 1 as llama.cpp (EngineConfig.act_planes)")
    parser.add_argument("--spec", default="off", choices=("off", "ngram"), help="also measure speculative decoding against off on a copy-heavy and a chat workload (bench.spec)")
    add_spec_arguments(parser, with_method=False)
    parser.add_argument("--kv-dtype", default=EngineConfig.kv_dtype, choices=["fp32", "bf16", "fp8_e4m3"])
    parser.add_argument("--kv-cache-bytes", type=positive, default=4 << 30)
    parser.add_argument("--threads", type=positive, default=torch.get_num_threads(), help="threads of every system (default: torch's, %(default)s)")
    parser.add_argument("--gguf", type=Path, help="the GGUF file llama.cpp loads (default: the bundled model's own file)")
    parser.add_argument("--probe-len", type=positive, nargs=2, default=[512, 128], metavar=("PROMPT", "OUTPUT"),
                        help="tokens of the prompt tok/s probe's prompt and of the decode tok/s probe's output (default: 512 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, help="default: all three on cpu; splitserve and transformers on cuda")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where splitserve and transformers run (default: cpu)")
    parser.add_argument("--roofline-context", type=positive, default=1024, help="--device cuda: prompt tokens of each roofline sequence (default: 1024)")
    args = parser.parse_args(argv)
    if args.systems is None:
        args.systems = list(SYSTEMS) if args.device == "cpu" else ["splitserve", "transformers"]
    if args.device == "cuda" and "llama.cpp" in args.systems:
        parser.error("--systems: the llama.cpp peer runs on the CPU here; with --device cuda compare splitserve and transformers")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU on this machine; nothing was measured")
    check_ranges(parser, args, "prompt_len", "output_len")
    if args.num_requests < max(args.concurrency):
        parser.error(f"--num-requests: {args.num_requests} requests never reach --concurrency {max(args.concurrency)}; pass at least that many")
    if args.probe_len[1] < 2:
        parser.error("--probe-len: OUTPUT must be at least 2 (decode is timed from the first output token)")
    return args


def _llama_cpp_peer(args, engine: LLMEngine, max_num_seqs: int, max_seq_len: int) -> LlamaCppPeer:
    """llama.cpp on the GGUF file splitserve loaded, once its tokenizer is shown to split text as splitserve's does."""
    if args.gguf is not None:
        gguf = args.gguf
    elif args.model in bundled_model_names():
        gguf = bundled_model(args.model).gguf_path()
    else:
        raise BenchError(f"llama.cpp needs a GGUF file: --model {args.model} is not a bundled model ({', '.join(bundled_model_names())}); pass --gguf PATH")
    if not gguf.is_file():
        raise BenchError(f"--gguf {gguf} is not a file")
    progress("engine", f"loading {gguf.name} into llama.cpp")
    peer = LlamaCppPeer(gguf, args.threads, max_num_seqs, max_seq_len)
    ours, theirs = engine.tokenizer.encode(VOCAB_PROBE_TEXT, add_special_tokens=False), peer.tokenize(VOCAB_PROBE_TEXT)
    if peer.vocab_size != engine.model_config.vocab_size or ours != theirs:
        peer.close()
        raise BenchError(f"{gguf.name}: llama.cpp's vocabulary ({peer.vocab_size} tokens, {VOCAB_PROBE_TEXT!r} -> {theirs}) is not splitserve's ({engine.model_config.vocab_size}, {ours})")
    return peer


def _systems(args, engine: LLMEngine, peer: LlamaCppPeer | None, workload: list[BenchRequest]) -> dict[str, System]:
    """The systems of ``args.systems``, loaded and warmed up, in that order."""
    systems = {}
    for name in args.systems:
        if name == "splitserve":
            systems[name] = System(partial(run_splitserve, engine), partial(splitserve_prefill, engine), partial(splitserve_decode_s, engine))
        elif name == "transformers":
            import transformers

            hf_model = transformers.AutoModelForCausalLM.from_pretrained(engine.checkpoint_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
            pad = engine.model_config.eos_token_ids[0] if engine.model_config.eos_token_ids else 0
            systems[name] = System(lambda w, n: run_transformers(hf_model, w, n, pad), partial(transformers_prefill, hf_model),
                                   lambda p, n: transformers_decode_s(hf_model, p, n, pad))
        else:
            systems[name] = System(partial(run_llama_cpp, peer), peer.prefill, peer.decode_s)
    progress("engine", f"warming up {', '.join(systems)}")
    warmup = [BenchRequest(r.prompt_token_ids, 4) for r in workload[:2]]
    for system in systems.values():
        system.serve(warmup, min(len(warmup), max(args.concurrency)))  # llama.cpp holds max(concurrency) sequences
    return systems


def _measure(args, systems: dict[str, System], workload: list[BenchRequest], vocab_size: int) -> dict:
    """The sweep (a row per concurrency and system), the single-stream probes, and the ratios."""
    results = []
    for concurrency in args.concurrency:
        for name, system in systems.items():
            results.append(r := system.serve(workload, concurrency))
            progress("engine", f"{name} N={concurrency}: {r['output_tok_per_s']} tok/s, TTFT p50 {r['ttft_s_p50']} s")
    rng = random.Random(args.seed + 1)
    (prompt_len, num_decode), decode_prompt = args.probe_len, random_tokens(rng, DECODE_PROBE_PROMPT_LEN, vocab_size)
    prompt_probe = random_tokens(rng, prompt_len, vocab_size)
    prompt_tok_per_s, decode_tok_per_s = {}, {}
    for name, system in systems.items():
        prompt_tok_per_s[name] = round(prompt_len / median_s(lambda: system.prefill(prompt_probe), 3), 2)
        decode_tok_per_s[name] = round((num_decode - 1) / system.decode_s(decode_prompt, num_decode), 2)
        progress("engine", f"{name}: prompt {prompt_tok_per_s[name]} tok/s ({prompt_len} tokens), decode {decode_tok_per_s[name]} tok/s ({num_decode} tokens)")
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "weights": args.weights,
        "act_planes": args.act_planes,
        "kv_dtype": args.kv_dtype,
        "threads": args.threads,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "machine": machine(),
        "results": results,
        "prompt_tok_per_s": prompt_tok_per_s,
        "decode_tok_per_s": decode_tok_per_s,
        "speedup": _ratios(results, "transformers"),
    }
    if "llama.cpp" in systems and "splitserve" in systems:
        report["vs_llama_cpp"] = _ratios(results, "llama.cpp", best_of_serial=True)
        report["vs_llama_cpp_prompt"] = round(prompt_tok_per_s["splitserve"] / prompt_tok_per_s["llama.cpp"], 3)
        report["vs_llama_cpp_decode"] = round(decode_tok_per_s["splitserve"] / decode_tok_per_s["llama.cpp"], 3)
    return report


def _ratios(results: list[dict], peer: str, best_of_serial: bool = False) -> dict[str, float]:
    """splitserve's output tok/s over ``peer``'s at each concurrency both ran. With
    ``best_of_serial`` the peer counts at the better of batching N streams and serving them one
    after another, whose aggregate is its N = 1 rate on the same workload."""
    by = {(r["system"], r["concurrency"]): r["output_tok_per_s"] for r in results}
    serial = by.get((peer, 1), 0.0) if best_of_serial else 0.0
    return {str(c): round(by[("splitserve", c)] / max(by[(peer, c)], serial), 3) for (s, c) in by if s == "splitserve" and (peer, c) in by}


if __name__ == "__main__":
    sys.exit(run("engine", main))
