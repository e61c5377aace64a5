"""What the benches drive: seeded synthetic workloads, local clusters and throwaway Redis servers."""

from __future__ import annotations

import contextlib
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.report import user_error
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams

if TYPE_CHECKING:  # a cluster needs Ray; the engine benches (and a GPU host without Ray) do not
    from router.client import SplitServeClient
    from router.control.launch import Cluster, ClusterConfig

NUM_SPECIAL_TOKENS = 32
"""Prompt token ids start above this, clear of SmolLM2's control tokens (ids 0-16)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: random prompt tokens and an exact output length (EOS ignored)."""

    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def random_tokens(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    """``num_tokens`` token ids drawn uniformly above the special tokens."""
    return [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(num_tokens)]


def start_decoding(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> None:
    """Add one greedy request per prompt (``num_tokens`` after the first) and step until every one
    has its first token: what follows is steady decode."""
    request_ids = [f"decode-{len(prompts)}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, prompt, greedy(num_tokens + 1))
    started: set[str] = set()
    while len(started) < len(request_ids):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)


def closed_loop(engine: LLMEngine, count: int, concurrency: int, add: Callable[[int], str], on_output: Callable = lambda out: None) -> tuple[int, float]:
    """Serve ``count`` requests on ``engine``, ``concurrency`` in flight, the next joining when one
    finishes: ``add(i)`` submits request i and returns its id, ``on_output`` sees every output.
    (output tokens, wall seconds)."""
    pending = iter(range(count))
    in_flight: set[str] = set()
    num_output = 0
    start = time.perf_counter()
    while True:
        while len(in_flight) < concurrency and (index := next(pending, None)) is not None:
            in_flight.add(add(index))
        if not in_flight:
            return num_output, time.perf_counter() - start
        for out in engine.step():
            on_output(out)
            num_output += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)


def random_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int, seed: int) -> list[BenchRequest]:
    """Prompt and output lengths uniform over their inclusive ranges; token ids skip special tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        prompt = tuple(random_tokens(rng, rng.randint(*prompt_len), vocab_size))
        out.append(BenchRequest(prompt, rng.randint(*output_len)))
    return out


def variant(workload: list[BenchRequest], tag: int) -> list[BenchRequest]:
    """The same lengths with new prompts: the first token becomes ``tag``, so every block key
    (each chains from the first block) differs from any other variant's."""
    return [replace(r, prompt_token_ids=(tag,) + r.prompt_token_ids[1:]) for r in workload]


@contextlib.contextmanager
def local_cluster(config: ClusterConfig) -> Iterator[tuple[Cluster, SplitServeClient]]:
    """A local cluster started from ``config`` and a client of its router; both stopped after."""
    from router.client import SplitServeClient
    from router.control.launch import Cluster

    cluster = Cluster(config)
    try:
        cluster.start()
        with SplitServeClient(cluster.router_status.grpc_address) as client:
            yield cluster, client
    finally:
        cluster.stop()


@contextlib.contextmanager
def redis_server(name: str):
    """A throwaway redis-server on a free loopback port (the tests' ``RedisServer``), stopped after;
    BenchError if it cannot start."""
    from tests.redis_server import RedisServer  # dev tooling, imported only by a bench that needs it

    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as workdir:
        with user_error(RuntimeError):
            server = RedisServer(Path(workdir)).start()
        try:
            yield server
        finally:
            server.stop()


def threads_per_rank(num_ranks: int) -> int:
    """Torch threads for each rank of a replica of ``num_ranks`` on this machine: the usable cores
    at one rank, cores // num_ranks (at least 1) above."""
    import os

    return max(1, len(os.sched_getaffinity(0)) // num_ranks)


@contextlib.contextmanager
def ranked_engine(config: EngineConfig, num_threads: int, name: str, start: Callable[[str], list] | None = None):
    """The leader's engine of a replica of ``config.num_ranks`` ranks (TP or EP), in this process,
    and its followers' handles (each rank a Ray actor with ``num_threads`` threads and its share
    of the cores); all stopped after. ``start``: as ``TPEngineBuilder``'s (the tests run the ranks
    in processes they keep); the followers it starts are the caller's to stop."""
    import os

    import ray

    from engine.parallel.ranks import TPEngineBuilder
    from router.control.launch import init_ray

    torch.set_num_threads(num_threads)
    followers = []
    try:
        if config.num_ranks == 1:
            engine = LLMEngine(config)
        else:
            init_ray(None)
            cpus_per_rank = round(min(1.0, len(os.sched_getaffinity(0)) / config.num_ranks), 2)
            builder = TPEngineBuilder(config, f"bench-{name}", num_cpus=cpus_per_rank, num_threads=num_threads, start=start)
            followers = builder.followers
            engine = builder()
        try:
            yield engine, followers
        finally:
            engine.close()
    finally:
        for follower in followers if start is None else ():
            ray.kill(follower)
