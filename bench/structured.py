"""Constrained decoding: llguidance (engine.structured) against xgrammar, and the engine's cost.

- ``compile``: per JSON schema, the grammar compile, cold (a constraint never seen) and cached
  (a cache hit plus a fresh matcher), through ``GrammarBackend``; xgrammar's ``GrammarCompiler``
  beside it, cold (its cache off) and cached, with the same layout (no free whitespace, ``", "``
  and ``": "`` separators). Median of ``--repeats``.
- ``mask``: both fill the next-token bitmask before each token of the same instances (tokenized by
  the model's tokenizer), then accept it: µs per token (mean, p50, p99).
- ``gil``: 8 masks filled by ``fill_bitmasks`` in a helper thread, over and over, while the main
  thread runs torch matmuls (1 torch thread): the matmuls' slowdown against running alone, and
  the fills' rate against theirs alone. The peer is a helper thread running Python, which holds
  the GIL: the matmuls then wait for it between ops. (A main thread running Python would
  say little: the helper gets the GIL back only every switch interval, whatever the fill does.)
- ``engine``: ``LLMEngine`` on the model, chat requests constrained by a schema (greedy, up to
  ``--max-tokens``), then the same requests free, each making as many tokens as its constrained
  answer, at each ``--concurrency``: output tok/s, answers that validate, and tokens appended by
  jump-forward (``EngineStats.num_forced_tokens``, where the engine has it).
  An engine that refuses constraints ends the run with exit status 2 after the other parts print.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import random
import statistics
import sys
import threading
import time

import torch

from bench.report import BenchError, arg_parser, emit_report, machine, percentile, positive, progress, run, user_error
from engine.bundled import resolve_model
from engine.errors import EngineError
from engine.params import Constraint, ConstraintKind, SamplingParams
from engine.structured.backend import GrammarBackend
from engine.structured.bitmask import allocate_bitmask, fill_bitmasks
from engine.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"}, "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
                   "status": {"enum": ["pending", "shipped", "delivered"]}, "notes": {"type": ["string", "null"]}},
    "required": ["id", "items", "status"],
    "$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}}, "required": ["sku", "qty"]}},
}
WEATHER_ARGUMENTS = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["location", "unit"],
}
TOOL_CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_ARGUMENTS}, "required": ["name", "arguments"]}
SCHEMAS = {"person": PERSON, "order": ORDER, "tool_call": TOOL_CALL}
INSTANCES = {
    "person": {"name": "Ada Lovelace", "age": 36, "city": "London"},
    "order": {"id": "AB-123456", "items": [{"sku": "kettle-2l", "qty": 1, "price": 24.5}, {"sku": "mug", "qty": 4}], "status": "shipped", "notes": None},
    "tool_call": {"name": "get_weather", "arguments": {"location": "Lisbon, Portugal", "unit": "celsius", "days": 3}},
}
TOPICS = ("a retired sailor", "a young chemist", "a baker in Paris", "a violin teacher", "a train driver", "a chess champion", "a beekeeper", "a pilot")


def xgrammar_compiler(xgr, tokenizer_json: str, vocab_size: int, eos_token_ids, cache_enabled: bool):
    vocab = json.loads(tokenizer_json)
    ids = {**vocab["model"]["vocab"], **{t["content"]: t["id"] for t in vocab["added_tokens"]}}
    encoded = [""] * vocab_size
    for token, token_id in ids.items():
        encoded[token_id] = token
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids))
    return xgr.GrammarCompiler(info, cache_enabled=cache_enabled)


def xgrammar_compile(compiler, schema: str):
    return compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))


def timed_s(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compile_report(backend: GrammarBackend, xgr, make_xgr, repeats: int) -> dict:
    out = {}
    warm_up = json.dumps({"type": "array", "items": {"type": "integer"}})  # one-time set-up costs, in neither figure
    backend.compile(Constraint(ConstraintKind.JSON_SCHEMA, warm_up))
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        # A distinct spec (trailing spaces) is a distinct cache key over the same schema: a cold compile.
        cold = [timed_s(lambda i=i: backend.compile(Constraint(ConstraintKind.JSON_SCHEMA, text + " " * (i + 1)))) for i in range(repeats)]
        cached = [timed_s(lambda: backend.matcher(Constraint(ConstraintKind.JSON_SCHEMA, text))) for _ in range(repeats + 1)][1:]
        row = {"llguidance_cold_ms": round(statistics.median(cold) * 1e3, 3), "llguidance_cached_us": round(statistics.median(cached) * 1e6, 1)}
        if xgr is not None:
            uncached, caching = make_xgr(False), make_xgr(True)
            xgrammar_compile(uncached, warm_up)
            row["xgrammar_cold_ms"] = round(statistics.median([timed_s(lambda: xgrammar_compile(uncached, text)) for _ in range(repeats)]) * 1e3, 3)
            xgrammar_compile(caching, text)
            warm = [timed_s(lambda: xgr.GrammarMatcher(xgrammar_compile(caching, text))) for _ in range(repeats)]
            row["xgrammar_cached_us"] = round(statistics.median(warm) * 1e6, 1)
        out[name] = row
        progress("structured", f"compile {name}: {row}")
    return out


def mask_report(backend: GrammarBackend, tokenizer: Tokenizer, xgr, make_xgr, vocab_size: int) -> dict:
    out = {}
    xgr_compiler = make_xgr(True) if xgr is not None else None
    for name, schema in SCHEMAS.items():
        text = json.dumps(INSTANCES[name])
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        bitmask = allocate_bitmask(1, vocab_size)
        matcher = backend.matcher(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
        row = {"num_tokens": len(token_ids), **summary("llguidance", per_token_us(lambda: matcher.fill_bitmask(bitmask, 0), matcher.accept, token_ids))}
        if xgr is not None:
            xgr_matcher = xgr.GrammarMatcher(xgrammar_compile(xgr_compiler, json.dumps(schema)))
            xgr_bitmask = xgr.allocate_token_bitmask(1, vocab_size)
            row.update(summary("xgrammar", per_token_us(lambda: xgr_matcher.fill_next_token_bitmask(xgr_bitmask, 0), xgr_matcher.accept_token, token_ids)))
        out[name] = row
        progress("structured", f"mask {name}: {row}")
    return out


def per_token_us(fill, accept, token_ids: list[int]) -> list[float]:
    """µs of ``fill()`` before each token, which ``accept`` must then take."""
    times_us = []
    for token_id in token_ids:
        times_us.append(timed_s(fill) * 1e6)
        if not accept(token_id):
            raise AssertionError(f"token {token_id} refused: the libraries disagree on the instance")
    return times_us


def summary(name: str, values_us: list[float]) -> dict:
    return {f"{name}_{stat}_us": round(value, 1) for stat, value in (("mean", statistics.fmean(values_us)), ("p50", percentile(values_us, 50)), ("p99", percentile(values_us, 99)))}


def gil_report(backend: GrammarBackend, tokenizer: Tokenizer, vocab_size: int) -> dict:
    rng = random.Random(0)
    pairs = []
    for row in range(8):
        name = list(SCHEMAS)[row % len(SCHEMAS)]
        matcher = backend.matcher(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS[name])))
        token_ids = tokenizer.encode(json.dumps(INSTANCES[name]), add_special_tokens=False)
        for token_id in token_ids[: rng.randrange(len(token_ids))]:
            matcher.accept(token_id)
        pairs.append((matcher, row))
    bitmask = allocate_bitmask(8, vocab_size)
    fill_us = [timed_s(lambda: fill_bitmasks(pairs, bitmask)) * 1e6 for _ in range(200)]

    python_work = lambda: sum(i for i in range(200_000))  # noqa: E731  (bytecode: holds the GIL)
    matrix = torch.randn(384, 384)
    matmul_work = lambda: [matrix @ matrix for _ in range(40)]  # noqa: E731

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {"fill_8_rows_mean_us": round(statistics.fmean(fill_us), 1), "fills_alone_per_s": round(1e6 / statistics.fmean(fill_us), 1)}
    alone_s = min(timed_s(matmul_work) for _ in range(7))  # min: the run least disturbed by the rest of the machine
    for helper_name, helper in (("fill_bitmasks", lambda: fill_bitmasks(pairs, bitmask)), ("python", python_work)):
        stop, num_runs = threading.Event(), [0]

        def loop(helper=helper, stop=stop, num_runs=num_runs) -> None:
            while not stop.is_set():
                helper()
                num_runs[0] += 1

        start_s = time.perf_counter()
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        beside_s = min(timed_s(matmul_work) for _ in range(7))
        stop.set()
        thread.join()
        out[f"matmul_slowdown_beside_{helper_name}"] = round(beside_s / alone_s, 3)
        if helper_name == "fill_bitmasks":
            out["fills_beside_matmul_per_s"] = round(num_runs[0] / (time.perf_counter() - start_s), 1)
    torch.set_num_threads(threads)
    progress("structured", f"gil: {out}")
    return out


def engine_report(backend: GrammarBackend, model: str, concurrencies: list[int], num_requests: int, max_tokens: int) -> dict:
    import jsonschema

    from bench.workload import closed_loop
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model))
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(PERSON))
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint)
    out = {"schema": "person", "max_tokens": max_tokens, "num_requests": num_requests}

    def serve(mode: str, concurrency: int, params_of) -> tuple[dict, list[list[int]]]:
        answers: list[list[int]] = [[] for _ in range(num_requests)]
        reasons: list[str | None] = [None] * num_requests
        add = lambda index: engine.add_request(f"{mode}-c{concurrency}-{index}", messages=chat(index), params=params_of(index)) or f"{mode}-c{concurrency}-{index}"  # noqa: E731

        def on_output(output) -> None:
            index = int(output.request_id.rsplit("-", 1)[1])
            answers[index].extend(output.new_token_ids)
            reasons[index] = output.finish_reason.value if output.finished else None

        engine.reset_prefix_cache()  # every run computes its prompts
        before = getattr(engine.stats(), "num_forced_tokens", None)
        num_output, wall_s = closed_loop(engine, num_requests, concurrency, add, on_output)
        after = getattr(engine.stats(), "num_forced_tokens", None)
        row = {"tok_per_s": round(num_output / wall_s, 2), "num_output_tokens": num_output, "finished_stop": reasons.count("stop")}
        if after is not None:
            row["num_forced_tokens"] = after - before
        progress("structured", f"engine {mode} c{concurrency}: {row}")
        return row, answers

    try:
        serve("warm-up", max(concurrencies), lambda index: constrained)  # the engine's grammar backend, the compile, first steps
        for concurrency in concurrencies:
            row, answers = serve("json_schema", concurrency, lambda index: constrained)
            row["num_valid"] = sum(valid(engine.tokenizer.decode(ids), jsonschema) for ids in answers)
            num_off_grammar = sum(not follows(backend.matcher(constraint), ids) for ids in answers)
            if num_off_grammar:
                raise BenchError(f"the engine does not enforce constraints yet: {num_off_grammar} of {num_requests} answers leave the grammar")
            # The peer: the same requests free, each making as many tokens as its constrained answer.
            free, _ = serve("unconstrained", concurrency, lambda index: SamplingParams(max_tokens=len(answers[index]), temperature=0, ignore_eos=True))
            out[f"json_schema_c{concurrency}"], out[f"unconstrained_c{concurrency}"] = row, free
            out[f"constrained_over_unconstrained_c{concurrency}"] = round(row["tok_per_s"] / free["tok_per_s"], 3)
    except (EngineError, NotImplementedError) as e:
        raise BenchError(f"the engine refuses constraints: {e}") from None
    finally:
        engine.close()
    return out


def chat(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Describe {TOPICS[index % len(TOPICS)]} (character {index}) as a JSON object with the keys name, age and city."}]


def follows(matcher, token_ids: list[int]) -> bool:
    """Whether the grammar accepts every token of an answer, in order."""
    return all(matcher.accept(token_id) for token_id in token_ids)


def valid(text: str, jsonschema) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--parts", nargs="+", default=["compile", "mask", "gil", "engine"], choices=("compile", "mask", "gil", "engine"), help="what to measure (default: all)")
    parser.add_argument("--repeats", type=positive, default=5, help="cold and cached compiles per schema and library (default: 5)")
    parser.add_argument("--concurrency", type=positive, nargs="+", default=[1, 8], help="engine: requests in flight (default: 1 8)")
    parser.add_argument("--num-requests", type=positive, default=32, help="engine: requests per mode and concurrency (default: 32)")
    parser.add_argument("--max-tokens", type=positive, default=48, help="engine: most output tokens per request (default: 48)")
    args = parser.parse_args(argv)
    with user_error(EngineError, prefix=f"model {args.model}: "):
        checkpoint_dir = resolve_model(args.model)
        tokenizer = Tokenizer.from_dir(checkpoint_dir)
    vocab_size = json.loads((checkpoint_dir / "config.json").read_text()).get("vocab_size", tokenizer.vocab_size)
    backend = GrammarBackend(tokenizer, vocab_size)
    try:
        import xgrammar as xgr
    except ImportError:  # its figures are reported missing
        xgr = None
    tokenizer_json = (checkpoint_dir / "tokenizer.json").read_text()
    make_xgr = lambda cache_enabled: xgrammar_compiler(xgr, tokenizer_json, vocab_size, tokenizer.eos_token_ids, cache_enabled)  # noqa: E731
    report = {"machine": machine(), "command": "python -m bench.structured " + " ".join(argv if argv is not None else sys.argv[1:])}
    report["peer"] = f"xgrammar {importlib.metadata.version('xgrammar')}" if xgr is not None else "xgrammar missing (pip install xgrammar)"
    if "compile" in args.parts:
        report["compile"] = compile_report(backend, xgr, make_xgr, args.repeats)
    if "mask" in args.parts:
        report["mask"] = mask_report(backend, tokenizer, xgr, make_xgr, vocab_size)
    if "gil" in args.parts:
        report["gil"] = gil_report(backend, tokenizer, vocab_size)
    report["compile_stats"] = dataclasses.asdict(backend.stats())
    refusal = None
    if "engine" in args.parts:
        try:
            report["engine"] = engine_report(backend, args.model, args.concurrency, args.num_requests, args.max_tokens)
        except BenchError as e:
            refusal, report["engine"] = e, {"error": str(e)}
    emit_report(report, args.json)
    if refusal is not None:
        raise refusal
    return 0


if __name__ == "__main__":
    sys.exit(run("structured", main))
