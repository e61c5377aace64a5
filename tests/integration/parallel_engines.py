"""Engines of several ranks (tensor- or expert-parallel) for tests, with the test process as rank 0."""

from __future__ import annotations

import contextlib

import ray
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.ranks import TPEngineBuilder


class ParallelEngines:
    """The engines a test asks for, built once per config. One-rank engines are kept; of the
    engines with followers only one lives at a time (a process joins one group at once), so
    asking for another closes the current one and kills its follower actors."""

    def __init__(self, follower_cpus: float, replica_id: str) -> None:
        self.follower_cpus = follower_cpus
        self.replica_id = replica_id
        self._single: dict[EngineConfig, LLMEngine] = {}
        self._config: EngineConfig | None = None
        self._engine: LLMEngine | None = None
        self.followers: list = []
        """Ray handles of the live engine's ranks 1 .. N-1."""

    def get(self, config: EngineConfig) -> LLMEngine:
        if config.num_ranks == 1:
            if config not in self._single:
                self._single[config] = LLMEngine(config)
            return self._single[config]
        if config != self._config:
            self.close_parallel()
            builder = TPEngineBuilder(config, self.replica_id, num_cpus=self.follower_cpus, num_threads=1)
            self.followers = builder.followers
            self._engine, self._config = builder(), config
        return self._engine

    def follower_infos(self) -> list[dict]:
        return ray.get([f.info.remote() for f in self.followers])

    def close_parallel(self) -> None:
        if self._engine is not None:
            self._engine.close()
        for follower in self.followers:
            ray.kill(follower)
        self._engine, self._config, self.followers = None, None, []


@contextlib.contextmanager
def parallel_engines(follower_cpus: float, replica_id: str):
    """ParallelEngines with this process on one torch thread, as each follower: on a small machine
    a leader's OpenMP team spinning on every core starves the followers it waits for."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engines = ParallelEngines(follower_cpus, replica_id)
    try:
        yield engines
    finally:
        engines.close_parallel()
        torch.set_num_threads(num_threads)
