"""TTFT of a long cached prefix served from each KV tier, against recomputing it; Redis GB/s.

One request is a ``--prefix-tokens`` prefix plus a fresh 16-token suffix, ``max_tokens`` 1, the
engine in-process. TTFT (median of ``--repeats``) with the prefix recomputed (``recompute``, the
peer), in the KV pool (``gpu``), or offloaded to the CPU tier (``cpu``) or Redis (``redis``).
Then the prefix's blocks go through the Redis tier beside raw pipelined redis-py SET/GET. Without
``--redis-url`` a throwaway redis-server is started.

``--tp N``: the replica is this process as rank 0 plus N-1 Ray actor ranks (as bench.parallel
builds it; threads per rank: the usable cores at TP 1, cores // N above). Each rank spills and
reloads its own KV heads of every block to its own CPU tier and to Redis (one value per KV head);
a Redis hit is measured once every rank's heads of the prefix are confirmed there. The GB/s
figures move the leader's slice (its heads) of each block.

``--ep N``: an expert-parallel replica of a mixture-of-experts model (``--model``, by default
bench.moe's random Mixtral with room for the prefix), attention data-parallel: each rank holds
whole blocks of its own requests. The prefix is first computed on rank 1 (beside a filler on rank
0), so the pool and CPU hits are rank 1's own blocks, moved by rank 1 (the request goes to the rank
whose pool or CPU tier holds its prefix), and the Redis hit is rank 0 loading what rank 1 spilled.
``measured_rank`` says where each tier's request ran.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import redis

from bench.report import BenchError, arg_parser, emit_report, machine, positive, progress, run, user_error
from bench.workload import greedy, random_tokens, ranked_engine, redis_server, threads_per_rank
from engine.bundled import resolve_model, served_model_name
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.parallel.sharding import check_ep_size, check_tp_size
from kv_store.events import Tier
from kv_store.keys import block_keys
from kv_store.redis_tier import RedisTier

TIERS = ("recompute", "gpu", "cpu", "redis")
"""Where the prefix is when a measured request arrives: nowhere (the peer), the KV pool, the CPU tier, Redis."""
REDIS_CONFIRM_TIMEOUT_S = 30.0
"""How long the offloaded prefix may take to be confirmed in Redis (every rank's KV heads written)."""


def _ttft(engine: LLMEngine, prompt: list[int], request_id: str) -> tuple[float, int]:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, greedy(1))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                return time.perf_counter() - start, out.num_cached_tokens


def _fill(engine: LLMEngine, prefix: list[int], tier: str) -> None:
    """Compute ``prefix`` once so that its blocks are cached: on an expert-parallel replica on
    rank 1, beside a filler that takes rank 0."""
    if engine.config.ep_size == 1:
        _ttft(engine, prefix, f"fill-{tier}")
        return
    filler = list(range(200, 200 + 2 * engine.config.block_size))
    engine.add_request(f"filler-{tier}", filler, greedy(1))
    engine.add_request(f"fill-{tier}", prefix, greedy(1))
    engine.run_to_completion([f"filler-{tier}", f"fill-{tier}"])
    if _rank_holding(engine, prefix) != 1:
        raise RuntimeError("the prefix was not computed on rank 1 beside the filler on rank 0")


def _rank_holding(engine: LLMEngine, prefix: list[int]) -> int | None:
    """The data-parallel rank whose pool caches ``prefix``'s first block, None if none does."""
    first = block_keys(prefix, engine.config.block_size, engine.namespace.root_key(None))[0]
    return next((rank for rank, pool in enumerate(engine.pools) if first in pool.cached_keys()), None)


def _place(engine: LLMEngine, tier: str, prefix: list[int]) -> None:
    """Put the cached prefix where ``tier`` says before a measured request."""
    if tier == "recompute":
        engine.reset_prefix_cache()
    elif tier in ("cpu", "redis"):
        engine.offload_prefix_cache()
        assert engine.pool.num_cached_blocks == 0
        if tier == "redis":
            _wait_in_redis(engine, prefix)


def _wait_in_redis(engine: LLMEngine, prefix: list[int]) -> None:
    """Until every block of ``prefix`` is confirmed in Redis: on a replica of several ranks the
    leader's ``flush`` covers only its own writes, so wait for the store's Redis key set."""
    if not engine.kv_store.redis.flush():
        raise RuntimeError("the Redis tier did not write the offloaded blocks within 10 s")
    keys = set(block_keys(prefix, engine.config.block_size, engine.namespace.root_key(None)))
    deadline = time.monotonic() + REDIS_CONFIRM_TIMEOUT_S
    while not keys <= engine.kv_store.key_sets()[Tier.REDIS]:
        if time.monotonic() > deadline:
            num_confirmed = len(keys & engine.kv_store.key_sets()[Tier.REDIS])
            raise RuntimeError(f"{num_confirmed} of the prefix's {len(keys)} blocks confirmed in Redis after {REDIS_CONFIRM_TIMEOUT_S:.0f} s")
        time.sleep(0.01)


def _measure(engine: LLMEngine, tier: str, prefix: list[int], repeats: int, rng: random.Random) -> dict:
    """TTFT of ``prefix`` + a fresh 16-token suffix, the prefix placed in ``tier`` before each repetition."""
    times, cached, ranks = [], [], []
    for i in range(repeats):
        _place(engine, tier, prefix)
        t, c = _ttft(engine, prefix + random_tokens(rng, 16, engine.model_config.vocab_size), f"{tier}-{i}")
        times.append(t)
        cached.append(c)
        ranks.append(_rank_holding(engine, prefix))
    return {"ttft_s": statistics.median(times), "ttft_s_all": [round(t, 4) for t in times], "cached_tokens": cached, "ranks": ranks}


def _redis_gbps(tier: RedisTier, url: str, engine: LLMEngine, prefix: list[int], repeats: int) -> dict:
    """Move the prefix's blocks through the tier and through raw redis-py, median GB/s."""
    engine.add_request("gbps", prefix, greedy(1))
    engine.run_to_completion(["gbps"])
    keys = block_keys(prefix, engine.config.block_size, engine.namespace.root_key(None))
    block_ids = engine.pool.match_prefix(keys)
    assert len(block_ids) == len(keys), "the prefix's blocks should all be in the pool"
    blocks = [engine.kv_cache.buffer[b].numpy().tobytes() for b in block_ids]
    nbytes = sum(len(b) for b in blocks)
    client = redis.Redis.from_url(url)  # the peer: plain redis-py, no header, no checksum
    pairs = list(zip(keys, blocks))

    def raw_set() -> list:
        pipe = client.pipeline(transaction=False)
        for k, b in pairs:
            pipe.set(f"bench:raw:{k}", b)
        return pipe.execute()

    def raw_get() -> list:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(f"bench:raw:{k}")
        return pipe.execute()

    moves = {"redis_put": lambda: tier.put_many(pairs), "redis_get": lambda: tier.get_prefix(keys), "raw_redis_py_set": raw_set, "raw_redis_py_get": raw_get}
    seconds: dict[str, list[float]] = {name: [] for name in moves}
    for _ in range(repeats):
        for name, move in moves.items():
            start = time.perf_counter()
            num_moved = len(move())
            seconds[name].append(time.perf_counter() - start)
            if num_moved != len(blocks):
                raise RuntimeError(f"{name}: moved {num_moved} of {len(blocks)} blocks")
    gbps = {f"{name}_gbps": round(nbytes / statistics.median(s) / 1e9, 3) for name, s in seconds.items()}
    return {**gbps, "redis_blocks": len(blocks), "redis_bytes": nbytes}


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=positive, default=1, help="tensor-parallel size of the replica (default: 1)")
    parser.add_argument("--ep", type=positive, default=1, help="expert-parallel size of the replica, on a mixture-of-experts model (default: 1)")
    parser.set_defaults(model=None)
    args = parser.parse_args(argv)
    if args.prefix_tokens < EngineConfig.block_size or args.repeats < 1:
        parser.error(f"--prefix-tokens: must be >= {EngineConfig.block_size} (one block); --repeats: must be >= 1")
    if args.tp > 1 and args.ep > 1:
        parser.error(f"--ep: a replica is tensor-parallel or expert-parallel, not both (--tp {args.tp}, --ep {args.ep})")
    with contextlib.ExitStack() as stack:
        if args.model is None and args.ep > 1:
            from bench.moe import make_model  # transformers and Ray: only for this case

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-kv-store-"))
            args.model = str(make_model(Path(tmp) / "tiny-mixtral", max_position_embeddings=args.prefix_tokens + 128))
            progress("kv_store", f"made a random Mixtral ({args.prefix_tokens + 128} positions) at {args.model}")
        args.model = args.model or "smollm2-135m"
        with user_error(EngineError, ValueError):  # a model that is not there, KV heads that do not split, no experts
            model_config = ModelConfig.from_dir(resolve_model(args.model, None))
            check_tp_size(served_model_name(args.model), model_config, args.tp)
            check_ep_size(served_model_name(args.model), model_config, args.ep)
        url = args.redis_url
        if url is None:
            url = stack.enter_context(redis_server("kv_store")).url
            progress("kv_store", f"started redis-server at {url}")
        try:
            redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        except (redis.RedisError, ValueError) as e:
            raise BenchError(f"no Redis answers at --redis-url {url}: {e}") from None
        report = _run(args, url)
    emit_report(report, args.json)
    return 0


def _run(args, url: str) -> dict:
    base = EngineConfig(model=args.model, kv_cache_bytes=256 << 20, max_model_len=args.prefix_tokens + 64, tp_size=args.tp, ep_size=args.ep)
    configs = {"recompute": base, "gpu": base, "cpu": replace(base, cpu_kv_cache_bytes=256 << 20), "redis": replace(base, redis_url=url)}
    rng, num_threads = random.Random(args.seed), threads_per_rank(base.num_ranks)
    results, redis_gbps, prefix = {}, {}, None
    for tier in TIERS:
        progress("kv_store", f"{tier}: loading {args.model} over {base.num_ranks} rank(s), {num_threads} torch thread(s) each")
        with contextlib.ExitStack() as stack:
            with user_error(EngineError):
                engine, _ = stack.enter_context(ranked_engine(configs[tier], num_threads, f"kv-store-{'ep' if args.ep > 1 else 'tp'}{base.num_ranks}-{tier}"))
            if engine.max_model_len < args.prefix_tokens + 16:
                raise BenchError(f"--prefix-tokens {args.prefix_tokens} + a 16-token suffix exceeds {args.model}'s {engine.max_model_len} tokens")
            prefix = prefix or random_tokens(rng, args.prefix_tokens, engine.model_config.vocab_size)
            _ttft(engine, list(range(100, 164)), f"warmup-{tier}")
            if tier != "recompute":
                _fill(engine, prefix, tier)  # the prefix's blocks now cached in the pool
            results[tier] = _measure(engine, tier, prefix, args.repeats, rng)
            progress("kv_store", f"{tier}: TTFT {results[tier]['ttft_s']:.4f} s, {results[tier]['cached_tokens']} tokens cached")
            if tier == "redis":
                progress("kv_store", f"redis: put and get {args.prefix_tokens // base.block_size} blocks x {args.repeats}")
                redis_gbps = _redis_gbps(engine.kv_store.redis, url, engine, prefix, args.repeats)
    recompute = results["recompute"]["ttft_s"]
    return {
        "model": args.model,
        "tp_size": args.tp,
        "ep_size": args.ep,
        "kv_dtype": base.kv_dtype,
        "prefix_tokens": args.prefix_tokens,
        "ttft_s": {k: round(v["ttft_s"], 4) for k, v in results.items()},
        "ttft_over_recompute": {k: round(v["ttft_s"] / recompute, 3) for k, v in results.items()},
        "cached_tokens": {k: v["cached_tokens"] for k, v in results.items()},
        "ttft_s_all": {k: v["ttft_s_all"] for k, v in results.items()},
        "measured_rank": {k: v["ranks"] for k, v in results.items()},
        **redis_gbps,
        "machine": machine(),
    }


if __name__ == "__main__":
    sys.exit(run("kv_store", main))
