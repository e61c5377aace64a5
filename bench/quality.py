"""What each weights format costs in quality and buys in speed, on the bundled model.

For each ``--weights`` choice (native, bf16, fp32, int8, int4) one engine is loaded and measured:

- perplexity on a fixed public-domain text (tests/data/alice_chapters_1_2.txt), scored in
  non-overlapping windows of ``--window`` tokens, every token after a window's first predicted;
- greedy generation of a few fixed prompts, compared token by token with fp32: tokens that
  agree before the first divergence, and in total;
- decode tok/s at concurrency 1: one request at a time in a closed loop on ``LLMEngine``, the
  time from its first output token to its last.

A row "fp32 + 2:4 pruned" (``engine.sparsity.prune_model_2_4``, magnitude pruning) shows the
perplexity cost of 2:4 sparsity; on a CPU it claims no speed. The KV pool is fp32 in every row
so that only the weights differ. Windows run as prefill steps of many rows, which take the
quantized formats' dense bf16 copies (the same dequantized values the decode kernels use);
``--decode-kernels`` sends them through the decode kernels instead, so the perplexity also
carries what those kernels round (the native kernel's int8 activations). ``--one-plane FORMAT``
adds rows for kernel formats run with one int8 activation plane (``EngineConfig.act_planes=1``);
where the CPU multiplies bf16 itself, pair it with ``--decode-kernels`` so the windows take the kernel.

    python -m bench.quality --json bench/results/quality.json
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from bench.report import BenchError, arg_parser, emit_report, machine, positive, progress, run, user_error
from engine.build import model_len
from engine.bundled import resolve_model
from engine.config import WEIGHT_FORMATS, EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.params import SamplingParams
from engine.step_plan import PlannedChunk, StepPlan
from engine.sparsity import prune_model_2_4

TEXT_PATH = Path(__file__).resolve().parent.parent / "tests" / "data" / "alice_chapters_1_2.txt"
PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
)
PRUNED = "fp32 + 2:4 pruned"
ONE_PLANE_FORMATS = ("native", "int8", "int4")
"""Formats the C kernel runs, which may take one activation plane (``--one-plane``)."""


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--weights", nargs="+", choices=WEIGHT_FORMATS, default=list(WEIGHT_FORMATS), help="formats to measure (default: all)")
    parser.add_argument("--window", type=positive, default=512, help="tokens per perplexity window (default: 512)")
    parser.add_argument("--max-text-tokens", type=positive, default=None, help="score only the text's first N tokens (default: all)")
    parser.add_argument("--gen-tokens", type=positive, default=32, help="greedy tokens per prompt (default: 32)")
    parser.add_argument("--decode-tokens", type=positive, default=64, help="tokens per c1 decode run (default: 64)")
    parser.add_argument("--threads", type=positive, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--decode-kernels", action="store_true", help="score the text through the decode kernels, not the dense copies")
    parser.add_argument("--one-plane", nargs="*", choices=ONE_PLANE_FORMATS, default=[], metavar="FORMAT",
                        help=f"also measure these of {ONE_PLANE_FORMATS} with one int8 activation plane (EngineConfig.act_planes=1, "
                             "llama.cpp's 8-bit activations), in rows labelled FORMAT/a8")
    args = parser.parse_args(argv)
    if "fp32" not in args.weights:
        raise BenchError("--weights: fp32 must be among them, the generations are compared with it")
    _check_window(args.model, args.window)
    if args.decode_kernels:
        _route_every_row_to_the_decode_kernels()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, generations = [], {}
    runs = [(w, 2) for w in ["fp32"] + [w for w in args.weights if w != "fp32"]] + [(w, 1) for w in args.one_plane]
    for weights, act_planes in runs:
        label = weights if act_planes == 2 else f"{weights}/a8"
        progress("quality", f"weights {label}: loading")
        engine = _engine(args.model, weights, args.window, act_planes)
        row, generations[label] = _measure(engine, label, args)
        rows.append(row)
        engine.close()
    _compare(rows, generations)
    rows.append(_pruned_row(args))
    settings = {name: getattr(args, name) for name in ("window", "max_text_tokens", "gen_tokens", "decode_tokens", "threads", "decode_kernels", "one_plane")}
    report = {"bench": "quality", "model": args.model, "machine": machine(), "text": TEXT_PATH.name, **settings, "rows": rows}
    emit_report(report, args.json)
    return 0


def _route_every_row_to_the_decode_kernels() -> None:
    from engine.quant import kernels

    for name in ("INT4_KERNEL_MAX_ROWS", "GROUP_INT8_KERNEL_MAX_ROWS", "TORCH_INT4_KERNEL_MAX_ROWS", "INT8_KERNEL_MAX_ROWS"):
        setattr(kernels, name, 1 << 30)


def _check_window(model: str, window: int) -> None:
    """Refuses a model that is not there, or a window longer than it serves, before any loads."""
    with user_error(EngineError, ValueError):
        max_len = model_len(EngineConfig(model=model), ModelConfig.from_dir(resolve_model(model, None)))
    if window > max_len:
        raise BenchError(f"--window {window} is longer than {model}'s {max_len} tokens")


def _engine(model: str, weights: str, window: int, act_planes: int = 2) -> LLMEngine:
    blocks = -(-window // 16) + 8
    with user_error(EngineError, ValueError):  # weights this model cannot be served in
        return LLMEngine(EngineConfig(model=model, weights=weights, act_planes=act_planes, kv_dtype="fp32", num_kv_blocks=blocks,
                                      max_num_batched_tokens=window))


def _measure(engine: LLMEngine, label: str, args) -> tuple[dict, list[tuple[int, ...]]]:
    progress("quality", f"weights {label}: perplexity")
    nll, num_scored = perplexity_terms(engine, args.window, args.max_text_tokens)
    progress("quality", f"weights {label}: greedy generations and c1 decode")
    greedy = SamplingParams(max_tokens=args.gen_tokens, temperature=0, ignore_eos=True)
    outputs = [c.output_token_ids for c in engine.generate(list(PROMPTS), greedy)]
    row = {
        "weights": label,
        "perplexity": round(math.exp(nll / num_scored), 3),
        "scored_tokens": num_scored,
        "decode_tok_per_s_c1": round(decode_tok_per_s(engine, args.decode_tokens), 2),
        "linear_weight_bytes": linear_weight_bytes(engine),
    }
    return row, outputs


@torch.inference_mode()
def perplexity_terms(engine: LLMEngine, window: int, max_tokens: int | None) -> tuple[float, int]:
    """``(sum of negative log-likelihoods, tokens scored)`` over the text, window by window.

    Each window runs as one prefill step straight on the model runner (blocks 0.. of the idle
    pool, nothing cached), with every row's logits kept.
    """
    token_ids = engine.tokenizer.encode(TEXT_PATH.read_text(encoding="utf-8"))[:max_tokens]
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = tuple(token_ids[start : start + window])
        if len(chunk) < 2:
            break
        blocks = tuple(range(-(-len(chunk) // 16)))
        plan = StepPlan(decodes=(), prefills=(PlannedChunk(0, len(chunk), chunk, blocks),), sample_rows=tuple(range(len(chunk))))
        logits = engine.runner.run(plan)
        log_probs = torch.log_softmax(logits[:-1].float(), dim=-1)
        targets = torch.tensor(chunk[1:])
        total -= log_probs[torch.arange(len(targets)), targets].sum().item()
        count += len(targets)
    return total, count


def decode_tok_per_s(engine: LLMEngine, num_tokens: int, repetitions: int = 3) -> float:
    """Median decode rate of one request alone: output tokens after the first over the time they took."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    rates = []
    for i in range(repetitions):
        engine.add_request(f"decode-{i}", "Tell me a long story about a lighthouse keeper.", params)
        first_at, last_at, count = None, None, 0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                count += len(out.new_token_ids)
                first_at = first_at or now
                last_at = now
        rates.append((count - 1) / (last_at - first_at))
    return sorted(rates)[len(rates) // 2]


def linear_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of linear-layer weights a decode step reads (the LM head included)."""
    from engine.quant.apply import linear_layers

    total = 0
    for _, module in linear_layers(engine.runner.model):
        total += module.quantized.nbytes if module.quantized is not None else module.weight.nbytes
    return total


def _compare(rows: list[dict], generations: dict[str, list[tuple[int, ...]]]) -> None:
    reference = generations["fp32"]
    for row in rows:
        prefix = total = length = 0
        for got, expected in zip(generations[row["weights"]], reference):
            same = [a == b for a, b in zip(got, expected)]
            prefix += same.index(False) if False in same else len(same)
            total += sum(same)
            length += len(expected)
        row["greedy_vs_fp32"] = {"agree_before_divergence": prefix, "agree_total": total, "tokens": length}


def _pruned_row(args) -> dict:
    progress("quality", f"{PRUNED}: loading and pruning")
    engine = _engine(args.model, "fp32", args.window)
    stats = prune_model_2_4(engine.runner.model)
    nll, num_scored = perplexity_terms(engine, args.window, args.max_text_tokens)
    return {"weights": PRUNED, "perplexity": round(math.exp(nll / num_scored), 3), "scored_tokens": num_scored, "prune_stats": _plain(stats)}


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


if __name__ == "__main__":
    raise SystemExit(run("quality", main))
