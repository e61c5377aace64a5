"""Expert parallelism on CPU (gloo): decode tok/s per batch size, expert weight bytes per rank,
all-to-all time per step and greedy identity at EP 1 and EP 2; transformers' generate is the peer.

The model is a random float32 Mixtral made here (4 layers, hidden 256, 8 experts of intermediate
1024, top-2), whose experts hold 96% of the weights. EP N is this process as rank 0 plus N-1 Ray
actor ranks. A batch is prefilled in one step; decode ITL is the median step once every request
has its first token, decode tok/s is batch / ITL. All-to-all time is the leader's wall time in
TPGroup.all_to_all and exchange_counts (dispatch, combine, their row counts) per decode step,
waits for the slowest rank included. The peer's decode tok/s is batch x N tokens over its time to
generate N + 1 tokens less its time for 1. Threads per rank: the cores at EP 1 and for the peer,
cores // N (at least 1) at EP N.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

from bench.report import arg_parser, emit_report, machine, plot, progress, run, user_error
from bench.parallel import size_list
from bench.workload import greedy, random_tokens, ranked_engine, start_decoding
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.layers.mlp import SparseMoE
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.parallel.group import TPGroup
from engine.parallel.sharding import check_ep_size, parameter_bytes

MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
FULL = {"prompt_tokens": 32, "decode_tokens": 64, "identity_tokens": 24}
QUICK = {"prompt_tokens": 8, "decode_tokens": 4, "identity_tokens": 8}
NUM_IDENTITY_PROMPTS = 8


def make_model(out_dir: Path, **overrides) -> Path:
    """The random Mixtral checkpoint (``MODEL``, with ``overrides``), with the tests' tiny tokenizer."""
    import transformers

    from tests.tiny_models import make_tiny_tokenizer  # dev tooling, as bench.workload's Redis server

    transformers.utils.logging.disable_progress_bar()  # stderr is one line per phase
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**(MODEL | overrides))).save_pretrained(out_dir)
    make_tiny_tokenizer(out_dir)
    return out_dir


@contextlib.contextmanager
def timed_exchanges():
    """``spent[0]``: wall seconds this process has spent in TPGroup's all-to-alls since entering."""
    spent, originals = [0.0], {name: getattr(TPGroup, name) for name in ("all_to_all", "exchange_counts")}

    def timed(fn):
        def call(*args):
            start = time.perf_counter()
            out = fn(*args)
            spent[0] += time.perf_counter() - start
            return out
        return call

    for name, fn in originals.items():
        setattr(TPGroup, name, timed(fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(TPGroup, name, fn)


def decode_steps(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> tuple[list[float], list[float]]:
    """Seconds of each decode step once every request has its first token, and of all-to-all within it."""
    start_decoding(engine, prompts, num_tokens)
    step_s, exchange_s = [], []
    with timed_exchanges() as spent:
        while engine.has_unfinished_requests():
            start, before = time.perf_counter(), spent[0]
            engine.step()
            step_s.append(time.perf_counter() - start)
            exchange_s.append(spent[0] - before)
    return step_s, exchange_s


def expert_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, SparseMoE) for p in (m.w13, m.w2))


def measure(engine: LLMEngine, followers: list, batches: list[int], sizes: dict, identity_prompts: list[list[int]]) -> tuple[dict, list]:
    """One EP size's figures and its greedy outputs of the identity prompts (the first run, so also the warm-up)."""
    ep, rng = engine.config.ep_size, random.Random(0)
    outputs = [c.output_token_ids for c in engine.generate(identity_prompts, greedy(sizes["identity_tokens"]))]
    result: dict = {"decode_tok_s": {}, "decode_itl_ms": {}, "all_to_all_ms_per_step": {}, "all_to_all_share_of_step": {}}
    for batch in batches:
        step_s, exchange_s = decode_steps(engine, [random_tokens(rng, sizes["prompt_tokens"], MODEL["vocab_size"]) for _ in range(batch)], sizes["decode_tokens"])
        itl_s = statistics.median(step_s)
        result["decode_itl_ms"][str(batch)] = round(1000 * itl_s, 2)
        result["decode_tok_s"][str(batch)] = round(batch / itl_s, 1)
        result["all_to_all_ms_per_step"][str(batch)] = round(1000 * statistics.median(exchange_s), 3)
        result["all_to_all_share_of_step"][str(batch)] = round(sum(exchange_s) / sum(step_s), 3)
        progress("moe", f"EP {ep} decode batch {batch}: {batch / itl_s:.1f} tok/s, {1000 * statistics.median(exchange_s):.2f} ms all-to-all per step")
    infos = ray.get([f.info.remote() for f in followers]) if followers else []  # ray.get([]) would start Ray
    replicated = parameter_bytes(engine.runner.model) - expert_bytes(engine.runner.model)
    result["expert_bytes_per_rank"] = [expert_bytes(engine.runner.model)] + [info["param_bytes"] - replicated for info in infos]
    result["param_bytes_per_rank"] = [parameter_bytes(engine.runner.model)] + [info["param_bytes"] for info in infos]
    tokens = torch.cat([engine.runner.model.expert_tokens()] + [torch.tensor(info["expert_tokens"]) for info in infos], dim=1).sum(dim=0)
    result["expert_tokens_per_rank"] = [int(t.sum()) for t in tokens.chunk(ep)]
    result["expert_load_max_over_mean"] = round(float(tokens.max() / tokens.float().mean()), 3)
    return result, outputs


def peer(model_dir: Path, batches: list[int], sizes: dict, num_threads: int) -> dict:
    """transformers' greedy generate on the same model and batch shapes (equal-length prompts, no padding)."""
    import transformers

    torch.set_num_threads(num_threads)
    model, rng, result = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), random.Random(0), {}

    def generate_s(ids: torch.Tensor, num_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - start

    for batch in batches:
        ids = torch.tensor([random_tokens(rng, sizes["prompt_tokens"], MODEL["vocab_size"]) for _ in range(batch)])
        generate_s(ids, 2)  # warm-up
        decode_s = generate_s(ids, sizes["decode_tokens"] + 1) - generate_s(ids, 1)
        result[str(batch)] = round(batch * sizes["decode_tokens"] / decode_s, 1)
        progress("moe", f"transformers decode batch {batch}: {result[str(batch)]} tok/s")
    return {"name": f"transformers {transformers.__version__} generate", "threads": num_threads, "decode_tok_s": result}


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, model=False, plot="decode tok/s and all-to-all ms per step over batch, per EP size")
    parser.add_argument("--ep", type=size_list, default=[1, 2], help="EP sizes, comma-separated; must include 1 (default: 1,2)")
    parser.add_argument("--batches", type=size_list, default=[1, 8, 32], help="decode batch sizes (default: 1,8,32)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['prompt_tokens']}-token prompts and {QUICK['decode_tokens']} decode steps")
    args = parser.parse_args(argv)
    if 1 not in args.ep:
        parser.error("--ep: must include 1, the reference for token identity and expert bytes")
    sizes, cores = QUICK if args.quick else FULL, len(os.sched_getaffinity(0))
    threads = {ep: max(1, cores // ep) for ep in args.ep}
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        model_dir = make_model(Path(tmp) / "tiny-mixtral")
        with user_error(EngineError):
            for ep in args.ep:
                check_ep_size(model_dir.name, ModelConfig.from_dir(model_dir), ep)
        seq_blocks = math.ceil((sizes["prompt_tokens"] + sizes["decode_tokens"] + 1) / EngineConfig.block_size)
        rng = random.Random(1)
        identity_prompts = [random_tokens(rng, rng.randint(4, 48), MODEL["vocab_size"]) for _ in range(NUM_IDENTITY_PROMPTS)]
        report_machine, results, outputs = machine(), {}, {}
        for ep in args.ep:
            progress("moe", f"EP {ep}: loading over {ep} rank(s), {threads[ep]} torch thread(s) each")
            config = EngineConfig(model=str(model_dir), kv_dtype="fp32", ep_size=ep, num_kv_blocks=16 + max(args.batches) * seq_blocks,
                                  max_num_batched_tokens=max(args.batches) * sizes["prompt_tokens"])
            start = time.perf_counter()
            with ranked_engine(config, threads[ep], f"ep{ep}") as (engine, followers):
                load_s = time.perf_counter() - start
                results[ep], outputs[ep] = measure(engine, followers, args.batches, sizes, identity_prompts)
            results[ep].update(load_s=round(load_s, 2), threads_per_rank=threads[ep], token_identical=outputs[ep] == outputs[1])
            progress("moe", f"EP {ep}: {results[ep]['expert_bytes_per_rank']} expert bytes per rank, identical to EP 1: {results[ep]['token_identical']}")
        peer_result = peer(model_dir, args.batches, sizes, cores)
    expert_bytes_per_rank = {str(ep): max(r["expert_bytes_per_rank"]) for ep, r in results.items()}
    report = {
        "model": dict(MODEL, architecture="MixtralForCausalLM", dtype="float32", expert_share_of_params=round(results[1]["expert_bytes_per_rank"][0] / results[1]["param_bytes_per_rank"][0], 3)),
        "kv_dtype": "fp32", "backend": "gloo", "prompt_tokens": sizes["prompt_tokens"], "decode_tokens": sizes["decode_tokens"],
        "identity": {"num_prompts": NUM_IDENTITY_PROMPTS, "num_tokens": sizes["identity_tokens"]},
        "threads": {str(ep): n for ep, n in threads.items()}, "threads_rule": "cores at EP 1 and for the peer, cores // EP (at least 1) per rank above",
        "machine": report_machine,
        "ep": {str(ep): r for ep, r in results.items()},
        "token_identical": all(r["token_identical"] for r in results.values()),
        "expert_bytes_per_rank": expert_bytes_per_rank,
        "expert_bytes_ratio_to_ep1": {ep: round(n / expert_bytes_per_rank["1"], 4) for ep, n in expert_bytes_per_rank.items()},
        "peer": peer_result,
    }
    emit_report(report, args.json)
    if args.plot is not None:
        by_batch = lambda key: {f"EP {ep}": (args.batches, [r[key][str(b)] for b in args.batches]) for ep, r in results.items()}  # noqa: E731
        plot(args.plot, "bench.moe: tiny random Mixtral (8 experts, top-2), CPU (gloo)", [
            ("decode tok/s", "batch", dict(by_batch("decode_tok_s"), transformers=(args.batches, [peer_result["decode_tok_s"][str(b)] for b in args.batches]))),
            ("all-to-all ms per step", "batch", by_batch("all_to_all_ms_per_step")),
        ], logx=True)
    return 0


if __name__ == "__main__":
    sys.exit(run("moe", main))
