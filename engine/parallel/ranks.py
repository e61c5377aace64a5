"""Starting a tensor-parallel replica's follower ranks as Ray actors (the one Ray-aware module of the engine).

The controller places a TP (or EP) replica in a placement group of one bundle per rank (STRICT_PACK:
one node), the leader in bundle 0. The leader starts rank r in bundle r. A pipelined replica has
one such group per stage (router/control/placement.py): the leader's, holding stage 0, and for
stage s the group named ``stage_group_name(<the leader's group's name>, s)``; rank
``s * tp_size + t`` goes to bundle t of stage s's group. The followers are
owned by the leader's actor, so Ray kills them when the leader dies or is killed: a replica
lives and dies as a whole. On a CUDA replica each rank's actor asks Ray for a GPU of its own
(``gpus_per_rank``), and ``TPGroup.join`` places the rank on the one Ray assigned it.
"""

from __future__ import annotations

from collections.abc import Callable

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.bundled import resolve_model, served_model_name
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.parallel.follower import TPFollower
from engine.parallel.group import free_address
from engine.parallel.pipeline import check_pp_size, join_replica
from engine.parallel.sharding import check_ep_size, check_tp_size


def rendezvous_address() -> str:
    """``host:port`` for rank 0 to listen on, on this node."""
    return free_address(ray.util.get_node_ip_address())


def assigned_gpu_ids() -> tuple[str, ...]:
    """The GPUs Ray assigned to this actor (none outside Ray or without ``num_gpus``), for ``TPGroup.join``."""
    return tuple(str(i) for i in ray.get_gpu_ids()) if ray.is_initialized() else ()


def gpus_per_rank(config: EngineConfig) -> float:
    """GPUs each rank's actor asks Ray for: one on a CUDA replica, none on a CPU one."""
    return 0.0 if config.device == "cpu" else 1.0


def stage_group_name(name: str, stage: int) -> str:
    """The placement group of stage ``stage`` of the replica whose leader's group is named ``name``
    (router/control/placement.py ``stage_group_name`` names them so)."""
    return name if stage == 0 else f"{name}-stage-{stage}"


def stage_groups(pp_size: int) -> list:
    """The placement group of each stage, stage 0's (the caller's own) first; Nones outside one."""
    group = ray.util.get_current_placement_group()
    if group is None or pp_size == 1:
        return [group] * pp_size
    name = ray.util.placement_group_table(group)["name"]
    return [group] + [ray.util.get_placement_group(stage_group_name(name, s)) for s in range(1, pp_size)]


def start_followers(
    config: EngineConfig, address: str, *, num_cpus: float, num_gpus: float = 0.0, num_threads: int = 1, follower_class: type = TPFollower
) -> list:
    """Ranks 1 .. num_ranks-1 of the replica whose leader listens at ``address``, each in its
    stage's placement group (``stage_groups``). ``follower_class`` is TPFollower or a worker role's subclass of it."""
    groups = stage_groups(config.pp_size)
    stage_ranks = config.num_ranks // config.pp_size
    actor = ray.remote(follower_class)
    followers = []
    for rank in range(1, config.num_ranks):
        stage, bundle = divmod(rank, stage_ranks)
        strategy = None
        if groups[stage] is not None:
            strategy = PlacementGroupSchedulingStrategy(groups[stage], placement_group_bundle_index=bundle, placement_group_capture_child_tasks=False)
        followers.append(
            actor.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                max_restarts=0,
                max_concurrency=1000,
                scheduling_strategy=strategy,
            ).remote(config, rank, address, num_threads)
        )
    return followers


class TPEngineBuilder:
    """Builds the leader's engine of a TP replica: followers start at once, the engine when called.

    Call it on the thread that will step the engine (``EngineLoop`` does): the leader joins the
    group there and the followers' loads run meanwhile.
    """

    def __init__(
        self,
        config: EngineConfig,
        replica_id: str,
        *,
        num_cpus: float,
        num_gpus: float | None = None,
        num_threads: int = 1,
        follower_class: type = TPFollower,
        start: Callable[[str], list] | None = None,
    ) -> None:
        """``start(address)`` starts ranks 1 .. num_ranks-1 joining the group at ``address`` and
        returns their Ray handles; by default new ``follower_class`` actors (``start_followers``)
        asking for ``num_gpus`` each (None: ``gpus_per_rank``)."""
        self.config = config
        self.replica_id = replica_id
        self.model_config = model_config = ModelConfig.from_dir(resolve_model(config.model, config.cache_dir))
        check_tp_size(served_model_name(config.model), model_config, config.tp_size)  # refuse before any follower starts
        check_ep_size(served_model_name(config.model), model_config, config.ep_size)
        check_pp_size(served_model_name(config.model), model_config, config.pp_size)
        self.address = rendezvous_address()
        if start is None:
            num_gpus = gpus_per_rank(config) if num_gpus is None else num_gpus
            self.followers = start_followers(
                config, self.address, num_cpus=num_cpus, num_gpus=num_gpus, num_threads=num_threads, follower_class=follower_class
            )
        else:
            self.followers = start(self.address)

    def __call__(self) -> LLMEngine:
        group = join_replica(self.config, self.model_config, 0, self.address, assigned_gpu_ids())
        try:
            return LLMEngine(self.config, worker_id=self.replica_id, group=group)
        except BaseException:  # a failed load: leave no process group and no follower behind
            group.close()
            for follower in self.followers:
                ray.kill(follower)  # they may wait in the start-up barrier, which would hold this actor's exit
            raise
