"""TTFT of a long cached prefix served from each KV tier, against recomputing it; Redis GB/s.

    python -m bench.kv_store --json OUT [--redis-url URL]

One request = a 2,048-token prefix (random token ids) + a fresh 16-token suffix, max_tokens 1,
SmolLM2-135M with its defaults (float32 weights, fp8 KV), in-process. TTFT runs from
``add_request`` to the first token:

- ``recompute``: nothing cached (the peer every tier is measured against);
- ``gpu``: the prefix's blocks still in the engine's KV pool;
- ``cpu``: pushed out of the pool into the CPU tier (``offload_prefix_cache``) before the request;
- ``redis``: pushed out of the pool into Redis (no CPU tier), the writes flushed, before the request.

Redis put/get GB/s moves the prefix's 128 blocks through the tier (header, checksum, one
pipeline each way) beside raw pipelined SET/GET of the same bytes with redis-py (the peer).
Without ``--redis-url`` a throwaway redis-server is started on a free loopback port.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import redis

from bench.report import BenchError, emit_report, machine, progress, run
from bench.workload import NUM_SPECIAL_TOKENS
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from kv_store.keys import block_keys
from kv_store.redis_tier import RedisTier

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _ttft(engine: LLMEngine, prompt: list[int], request_id: str) -> tuple[float, int]:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, FIRST_TOKEN)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                return time.perf_counter() - start, out.num_cached_tokens


def _measure(engine: LLMEngine, prefix: list[int], vocab: int, repeats: int, rng: random.Random, prepare, name: str) -> dict:
    """TTFT of ``prefix`` + a fresh suffix, ``prepare(engine)`` run before each repetition."""
    times, cached = [], []
    for i in range(repeats):
        prepare(engine)
        suffix = [rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(16)]
        t, c = _ttft(engine, prefix + suffix, f"{name}-{i}")
        times.append(t)
        cached.append(c)
    return {"ttft_s": statistics.median(times), "ttft_s_all": [round(t, 4) for t in times], "cached_tokens": cached}


def _redis_gbps(tier: RedisTier, url: str, engine: LLMEngine, prefix: list[int], repeats: int) -> dict:
    """Move the prefix's blocks through the tier and through raw redis-py, median GB/s."""
    engine.add_request("gbps", prefix, FIRST_TOKEN)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.prefix_tokens < EngineConfig.block_size or args.repeats < 1:
        parser.error(f"--prefix-tokens: must be >= {EngineConfig.block_size} (one block); --repeats: must be >= 1")

    server = None
    url = args.redis_url
    if url is None:
        from tests.redis_server import RedisServer  # dev tooling shared with the tests

        server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis-"))).start()
        url = server.url
        progress("kv_store", f"started redis-server at {url}")
    try:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        except (redis.RedisError, ValueError) as e:
            raise BenchError(f"no Redis answers at --redis-url {url}: {e}") from None
        base = EngineConfig(model=args.model, kv_cache_bytes=256 << 20, max_model_len=args.prefix_tokens + 64)
        configs = {"recompute": base, "gpu": base, "cpu": replace(base, cpu_kv_cache_bytes=256 << 20), "redis": replace(base, redis_url=url)}
        rng = random.Random(args.seed)
        results, report_extra = {}, {}
        prefix = None
        for name, config in configs.items():
            progress("kv_store", f"{name}: loading {args.model}")
            try:
                engine = LLMEngine(config)
            except EngineError as e:
                raise BenchError(str(e)) from None
            if engine.max_model_len < args.prefix_tokens + 16:
                raise BenchError(f"--prefix-tokens {args.prefix_tokens} + a 16-token suffix exceeds {args.model}'s {engine.max_model_len} tokens")
            vocab = engine.model_config.vocab_size
            if prefix is None:
                prefix = [rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(args.prefix_tokens)]
            _ttft(engine, list(range(100, 164)), f"warmup-{name}")
            if name != "recompute":
                _ttft(engine, prefix, f"fill-{name}")  # the prefix's blocks now cached in the pool

            def prepare(e: LLMEngine, name: str = name) -> None:
                if name == "recompute":
                    e.reset_prefix_cache()
                elif name in ("cpu", "redis"):
                    e.offload_prefix_cache()
                    assert e.pool.num_cached_blocks == 0
                    if name == "redis" and not e.kv_store.redis.flush():
                        raise RuntimeError("the Redis tier did not write the offloaded blocks within 10 s")

            results[name] = _measure(engine, prefix, vocab, args.repeats, rng, prepare, name)
            progress("kv_store", f"{name}: TTFT {results[name]['ttft_s']:.4f} s, {results[name]['cached_tokens']} tokens cached")
            if name == "redis":
                progress("kv_store", f"redis: put and get {args.prefix_tokens // base.block_size} blocks x {args.repeats}")
                report_extra = _redis_gbps(engine.kv_store.redis, url, engine, prefix, args.repeats)
            engine.close()
            del engine
        recompute = results["recompute"]["ttft_s"]
        report = {
            "model": args.model,
            "kv_dtype": base.kv_dtype,
            "prefix_tokens": args.prefix_tokens,
            "ttft_s": {k: round(v["ttft_s"], 4) for k, v in results.items()},
            "ttft_over_recompute": {k: round(v["ttft_s"] / recompute, 3) for k, v in results.items()},
            "cached_tokens": {k: v["cached_tokens"] for k, v in results.items()},
            "ttft_s_all": {k: v["ttft_s_all"] for k, v in results.items()},
            **report_extra,
            "machine": machine(),
        }
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.workdir, ignore_errors=True)
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(run("kv_store", main))
