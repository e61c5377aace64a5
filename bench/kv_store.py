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
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench.workload import emit_report
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from kv_store.keys import block_keys
from kv_store.redis_tier import RedisTier

NUM_SPECIAL_TOKENS = 32
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
    puts, gets, raw_puts, raw_gets = [], [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        assert len(tier.put_many(list(zip(keys, blocks)))) == len(blocks)
        puts.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert len(tier.get_prefix(keys)) == len(blocks)
        gets.append(time.perf_counter() - t)
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k, b in zip(keys, blocks):
            pipe.set(f"bench:raw:{k}", b)
        pipe.execute()
        raw_puts.append(time.perf_counter() - t)
        t = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(f"bench:raw:{k}")
        pipe.execute()
        raw_gets.append(time.perf_counter() - t)
    gbps = lambda ts: round(nbytes / statistics.median(ts) / 1e9, 3)  # noqa: E731
    return {
        "redis_put_gbps": gbps(puts),
        "redis_get_gbps": gbps(gets),
        "raw_redis_py_set_gbps": gbps(raw_puts),
        "raw_redis_py_get_gbps": gbps(raw_gets),
        "redis_blocks": len(blocks),
        "redis_bytes": nbytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    server = None
    url = args.redis_url
    if url is None:
        from tests.redis_server import RedisServer  # dev tooling shared with the tests

        server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-redis-"))).start()
        url = server.url
    try:
        base = EngineConfig(model=args.model, kv_cache_bytes=256 << 20, max_model_len=args.prefix_tokens + 64)
        configs = {
            "recompute": base,
            "gpu": base,
            "cpu": EngineConfig(**{**base.__dict__, "cpu_kv_cache_bytes": 256 << 20}),
            "redis": EngineConfig(**{**base.__dict__, "redis_url": url}),
        }
        rng = random.Random(args.seed)
        results, report_extra = {}, {}
        prefix = None
        for name, config in configs.items():
            engine = LLMEngine(config)
            vocab = engine.model_config.vocab_size
            if prefix is None:
                prefix = [rng.randrange(NUM_SPECIAL_TOKENS, vocab) for _ in range(args.prefix_tokens)]
            _ttft(engine, list(range(100, 164)), f"warmup-{name}")
            if name != "recompute":
                _ttft(engine, prefix, f"fill-{name}")  # the prefix's blocks now cached in the pool

            def prepare(e, name=name):
                if name == "recompute":
                    e.reset_prefix_cache()
                elif name in ("cpu", "redis"):
                    e.offload_prefix_cache()
                    if name == "redis":
                        assert e.kv_store.redis.flush()
                        assert e.pool.num_cached_blocks == 0

            results[name] = _measure(engine, prefix, vocab, args.repeats, rng, prepare, name)
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
            if name == "redis":
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
        }
    finally:
        if server is not None:
            server.stop()
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
