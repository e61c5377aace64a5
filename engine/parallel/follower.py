"""A follower rank of a tensor-parallel replica: its shard of the model and of the KV pool.

It runs on one thread of its own (as the leader's engine does, for the same OpenMP reason,
engine/engine_loop.py): join the group, load the shard, then run every step plan the leader
sends until the leader says stop. It holds no scheduler and samples nothing. The methods
below are what the leader (a Ray actor) asks of it; the Ray side is engine/parallel/ranks.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch

from engine.bundled import resolve_model, served_model_name
from engine.config import EngineConfig
from engine.build import build_shard, key_namespace, model_len, split_group
from engine.model_config import ModelConfig
from engine.parallel.pipeline import PipelineGroup, join_replica
from engine.parallel.sharding import rank_fields
from engine.parallel.tier_mirror import FollowerTiers
from engine.runner import ModelRunner

logger = logging.getLogger(__name__)


class TPFollower:
    """Rank ``rank`` (> 0) of a replica whose leader listens at ``address``."""

    def __init__(self, config: EngineConfig, rank: int, address: str, num_threads: int = 1) -> None:
        if not 0 < rank < config.num_ranks:
            raise ValueError(f"rank: a follower's rank is in [1, {config.num_ranks}), got {rank}")
        self.config = config
        self.rank = rank
        self.node_ip = address.rpartition(":")[0]
        self.runner: ModelRunner | None = None
        self.tiers: FollowerTiers | None = None
        """This rank's CPU tier and Redis values, when the replica has KV tiers: its slice of every
        block (tensor-parallel) or its own requests' blocks (expert-parallel)."""
        self.failure: BaseException | None = None
        self._built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, num_threads), name=f"tp-rank-{rank}", daemon=True)
        self._thread.start()
        self._built.wait()
        if self.failure is not None:
            raise self.failure

    def _run(self, address: str, num_threads: int) -> None:
        try:
            torch.set_num_threads(num_threads)
            checkpoint_dir = resolve_model(self.config.model, self.config.cache_dir)
            model_config = ModelConfig.from_dir(checkpoint_dir)
            group = join_replica(self.config, model_config, self.rank, address, _assigned_gpu_ids())
            tp, ep = split_group(self.config, group)
            pipe = group if isinstance(group, PipelineGroup) else None
            stage = pipe.stage if pipe is not None else None
            model, kv_cache = build_shard(self.config, model_config, checkpoint_dir, model_len(self.config, model_config), tp, ep, stage)
            self.runner = ModelRunner(model, kv_cache, tp, ep, pipe)
            if self.config.cpu_kv_cache_bytes or self.config.redis_url is not None:
                namespace = key_namespace(self.config, served_model_name(self.config.model), checkpoint_dir, tp.size)
                self.tiers = FollowerTiers(self.config, group, kv_cache.buffer, kv_cache.layout, namespace, model.shard.kv_heads, model_config.num_kv_heads)
            group.barrier()
        except BaseException as e:  # reported by __init__
            self.failure = e
            return
        finally:
            self._built.set()
        try:
            if self.runner.pipe is not None and not self.runner.pipe.stage.is_first:
                self.runner.follow_pipeline()
            else:
                self.runner.follow(self.tiers.apply if self.tiers is not None else None)
        except BaseException as e:  # the leader sees the broken collective; keep the reason for info()
            logger.exception("rank %d of a %d-rank replica: its step loop failed", self.rank, self.config.num_ranks)
            self.failure = e
        finally:
            if self.tiers is not None:
                self.tiers.close()
            group.close()

    def info(self) -> dict:
        """Rank, liveness, steps run and what the rank holds (for status and tests)."""
        model = self.runner.model
        return dict(
            rank_fields(self.rank, model, self.node_ip, alive=self._thread.is_alive()),
            failure=repr(self.failure) if self.failure else "",
            num_steps=self.runner.num_runs,
            num_kv_blocks=self.runner.kv_cache.num_blocks,
            num_tier_moves=self.tiers.num_moves if self.tiers is not None else 0,
            expert_tokens=expert_tokens.tolist() if (expert_tokens := model.expert_tokens()) is not None else [],
            stage=model.stage.index,
            layer_start=model.stage.layers.start,
            layer_end=model.stage.layers.stop,
            kv_bytes=self.runner.kv_cache.buffer.numel(),
            busy_s=round(self.runner.busy_s, 4),
            redis_stats=dataclasses.asdict(self.tiers.redis.stats_snapshot()) if self.tiers is not None and self.tiers.redis is not None else {},
        )

    def alive(self) -> bool:
        return self._thread.is_alive()


def _assigned_gpu_ids() -> tuple[str, ...]:
    """The GPUs Ray gave this actor (none outside Ray, or on CPU); imported here, at the actor's edge."""
    import ray

    return tuple(str(i) for i in ray.get_gpu_ids()) if ray.is_initialized() else ()
