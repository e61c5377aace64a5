"""Speculative decoding: speedup and acceptance of n-gram drafting against plain decoding, one run.

Two workloads on the bundled instruct model, each prompt built with its chat template:

- ``copy``: edit a given passage (fix its typos, keep everything else), so the answer repeats
  much of the prompt: what prompt-lookup drafting is for.
- ``chat``: open questions whose answers copy nothing, where drafting must not cost speed
  (the engine stops drafting for a sequence whose drafts are rejected).

Each runs with ``speculative`` off and on, at concurrency 1 and 8 (a closed loop: the next
request joins when one finishes), greedy, so both runs produce the same tokens; the two modes
alternate ``--spec-repeats`` times and the best run of each counts. Reported per
workload: the acceptance rate (accepted / verified drafts) and the speedup in output tokens per
second at each concurrency. ``spec_report`` is what ``bench.engine --spec`` calls.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from bench.report import BenchError, arg_parser, emit_report, machine, progress, run
from bench.workload import closed_loop
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams

PASSAGES = (
    "The old lighthouse stood at the edge of the cliff for more then two hundred years. Every night its keeper "
    "climbed the narow stairs, lit the lamp and watched the ships pass safely into the harbour. When the town "
    "built a new electric beacon, the keeper stayed on anyway, polishing the brass and writing down the weather "
    "in a thick leather book that nobody else ever read.",
    "To make a simple loaf of bread, mix flour, water, salt and yeast in a large bowl until a soft dough forms. "
    "Knead the dough for ten minutes, then leave it covered in a warm place untill it has doubled in size. Shape "
    "it into a loaf, let it rise again for half an hour, and bake it in a hot oven for about fourty minutes.",
    "Our team meeting is moved from Tuesday to Thursday at three o'clock in the afternoon. Please bring the "
    "quarterly numbers, your list of open issues and any questions about the new release schedule. If you cannot "
    "attend, send your update by email before the meeting so that we can discus it without you.",
    "Rivers shape the land they flow through. Over thousands of years they cut valleys, carry sand and stones "
    "downstream and build wide plains where they slow down near the sea. Many of the worlds largest cities grew "
    "beside rivers, because the water brought food, trade and a way to travel inland.",
)
COPY_TASKS = ("Fix the spelling mistakes in this text and write out the whole corrected text:", "Rewrite this text exactly, correcting any typos:")
CHAT_QUESTIONS = (
    "What are three good habits for staying healthy?",
    "Explain in a few sentences why the sky is blue.",
    "Give me some ideas for a birthday party for a ten year old.",
    "How do I start learning to play the guitar?",
    "Write a short poem about autumn.",
    "What is the difference between weather and climate?",
    "Why do cats purr?",
    "Suggest a plan for a rainy Sunday afternoon.",
)
CONCURRENCIES = (1, 8)


def add_spec_arguments(parser: argparse.ArgumentParser, with_method: bool = True) -> None:
    """The options ``spec_report`` reads (``bench.engine`` names the method with its own ``--spec``)."""
    if with_method:
        parser.add_argument("--spec-method", default="ngram", choices=("ngram",), help="drafting measured against speculative off (default: ngram)")
    parser.add_argument("--spec-requests", type=int, default=8, help="requests per workload and run (default: 8)")
    parser.add_argument("--spec-max-tokens", type=int, default=128, help="most output tokens per request (default: 128)")
    parser.add_argument("--spec-repeats", type=int, default=2, help="runs of each mode, alternating off and on; the best counts (default: 2)")


def workloads() -> dict[str, list[list[dict[str, str]]]]:
    """Chat messages of each workload, in a fixed order."""
    copy = [[{"role": "user", "content": f"{COPY_TASKS[i % len(COPY_TASKS)]}\n\n{p}"}] for i, p in enumerate(PASSAGES * 2)]
    chat = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    return {"copy": copy, "chat": chat}


def run_closed_loop(engine: LLMEngine, conversations: list[list[dict[str, str]]], concurrency: int, max_tokens: int) -> tuple[int, float]:
    """Serve every conversation, ``concurrency`` at a time; (output tokens, wall seconds)."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0)

    def add(index: int) -> str:
        request_id = f"spec-{concurrency}-{index}"
        engine.add_request(request_id, messages=conversations[index], params=params)
        return request_id

    return closed_loop(engine, len(conversations), concurrency, add)


def spec_report(args: argparse.Namespace, make_engine: Callable[..., LLMEngine]) -> dict:
    """``{"spec": {workload: {"acceptance", "speedup_c1", "speedup_c8", ...}}}``: ``make_engine(**overrides)``
    builds an engine of the measured configuration with EngineConfig fields overridden."""
    if min(args.spec_requests, args.spec_max_tokens, args.spec_repeats) < 1:
        raise BenchError("--spec-requests, --spec-max-tokens and --spec-repeats must be >= 1")
    engines = {"off": make_engine(speculative="off"), args.spec_method: make_engine(speculative=args.spec_method)}
    spec_engine = engines[args.spec_method]
    out = {}
    for name, conversations in workloads().items():
        conversations = (conversations * args.spec_requests)[: args.spec_requests]
        row: dict[str, float] = {}
        drafted = accepted = 0
        for concurrency in CONCURRENCIES:
            tok_per_s = dict.fromkeys(engines, 0.0)
            for _ in range(args.spec_repeats):  # alternating, so a busy spell of the machine hits both
                for mode, engine in engines.items():
                    before = spec_engine.stats()
                    num_output, wall_s = run_closed_loop(engine, conversations, concurrency, args.spec_max_tokens)
                    tok_per_s[mode] = max(tok_per_s[mode], num_output / wall_s)
                    if engine is spec_engine:
                        after = spec_engine.stats()
                        drafted += after.num_draft_tokens - before.num_draft_tokens
                        accepted += after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
                    progress("spec", f"{name} c{concurrency} {mode}: {num_output} tokens, {num_output / wall_s:.1f} tok/s")
            row[f"tok_per_s_off_c{concurrency}"] = round(tok_per_s["off"], 2)
            row[f"tok_per_s_{args.spec_method}_c{concurrency}"] = round(tok_per_s[args.spec_method], 2)
            row[f"speedup_c{concurrency}"] = round(tok_per_s[args.spec_method] / tok_per_s["off"], 3)
        row["acceptance"] = round(accepted / drafted, 3) if drafted else 0.0
        row["num_draft_tokens"] = drafted
        out[name] = row
    for engine in engines.values():
        engine.close()
    return {"spec": out}


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    add_spec_arguments(parser)
    args = parser.parse_args(argv)

    def make_engine(**overrides) -> LLMEngine:
        return LLMEngine(EngineConfig(model=args.model, **overrides))

    progress("spec", f"model {args.model}: {args.spec_requests} requests per workload, up to {args.spec_max_tokens} tokens each")
    report = {"machine": machine(), "command": "python -m bench.spec " + " ".join(argv if argv is not None else sys.argv[1:])}
    report.update(spec_report(args, make_engine))
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(run("spec", main))
