"""Placing a multi-rank replica: one placement group per pipeline stage, each stage's ranks on one node.

A replica of TP size N is N processes that exchange activations every layer, so they must share
a node: a STRICT_PACK placement group of N bundles, the leader in bundle 0 (with the replica's
own CPUs and its pool's slot) and follower rank r in bundle r (``tp_rank_cpus`` each, or one
GPU each where the replica runs on GPUs). Before asking Ray for it, the controller checks that
some node could hold it at all, so an impossible size fails at once with a sentence saying what
is needed and what exists, instead of a placement group that waits forever. When the controller
follows the nodes (Kubernetes), the group is pinned to one node by the ``ray.io/node-id`` label
Ray gives every node.

A pipelined replica (PP x TP ranks) gets one STRICT_PACK group per stage: a stage's TP ranks
exchange activations every layer and share a node, while stages pass one hidden stream per
micro-batch point to point and may sit on different nodes. Ray places the groups independently,
so the stages land packed on one node or spread over several, wherever they fit; a single group
of PACK strategy would let a stage's ranks straddle nodes. Stage 0's group holds the leader (its
bundle 0) and is named after the replica; stage s's is ``<that name>-stage-<s>`` (the name
``engine.parallel.ranks`` looks up to put stage s's ranks in it)::

    splitserve-decode-3          [leader, rank 1, .., rank T-1]        stage 0, one node
    splitserve-decode-3-stage-1  [rank T, .., rank 2T-1]               stage 1, one node (maybe another)

All of a replica's groups are reserved together and released together (``reserve_stages``,
``release``). Before asking Ray, the controller checks that some set of nodes could hold every
stage (``check_stages_fit``).

Groups are detached and named after their replica (``splitserve-decode-3``): a group an actor
creates dies with it otherwise, and the ranks in it with the group, so a controller's death would
take every multi-rank replica down. A restarted controller finds a replica's groups by that name
(``find_replica_groups``), and removes the groups of replicas that never finished starting
(``replica_of_group`` names a group's replica).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, placement_group_table, remove_placement_group

from router.control.node_slots import is_alive
from router.errors import PlacementError

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node, holding its id: a placement group's bundles select a node by it."""
STAGE_SUFFIX = "-stage-"
"""Stage s >= 1 of a pipelined replica is placed in the group ``<replica's group name>-stage-<s>``
(engine/parallel/ranks.py ``stage_group_name`` spells the same)."""
_STAGE_NAME = re.compile(r"(.+)-stage-(\d+)")


def stage_group_name(name: str, stage: int) -> str:
    """The name of stage ``stage``'s group of the replica whose (stage 0) group is named ``name``."""
    return name if stage == 0 else f"{name}{STAGE_SUFFIX}{stage}"


def replica_of_group(group_name: str) -> str:
    """The replica group name a stage group belongs to (itself for a stage 0 group)."""
    match = _STAGE_NAME.fullmatch(group_name)
    return match.group(1) if match else group_name


def bundles(tp_size: int, leader_cpus: float, rank_cpus: float, pool_resource: str, gpus_per_rank: float = 0.0) -> list[dict[str, float]]:
    """The placement group's bundles: the leader's first, then one per follower rank."""
    leader = {"CPU": leader_cpus, pool_resource: 1.0}
    rank = {"CPU": rank_cpus}
    if gpus_per_rank:
        leader["GPU"] = rank["GPU"] = gpus_per_rank
    return [{k: v for k, v in leader.items() if v}] + [{k: v for k, v in rank.items() if v} for _ in range(tp_size - 1)]


def stage_bundles(
    pp_size: int, tp_size: int, leader_cpus: float, rank_cpus: float, pool_resource: str, gpus_per_rank: float = 0.0
) -> list[list[dict[str, float]]]:
    """Each stage's bundles, stage 0 first: stage 0 is ``bundles`` of a TP ``tp_size`` replica (the
    leader in bundle 0), every other stage ``tp_size`` follower-rank bundles."""
    rank = bundles(2, leader_cpus, rank_cpus, pool_resource, gpus_per_rank)[1]
    return [bundles(tp_size, leader_cpus, rank_cpus, pool_resource, gpus_per_rank)] + [[dict(rank) for _ in range(tp_size)] for _ in range(pp_size - 1)]


def _total(wanted: Sequence[dict[str, float]]) -> dict[str, float]:
    need: dict[str, float] = {}
    for bundle in wanted:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    return need


def _holds(room: dict[str, float], need: dict[str, float]) -> bool:
    return all(room.get(k, 0.0) >= v for k, v in need.items())


def _copies(room: dict[str, float], need: dict[str, float]) -> int:
    """How many times ``need`` fits in ``room``."""
    counts = [int(room.get(k, 0.0) // v) for k, v in need.items() if v > 0]
    return min(counts) if counts else 1 << 30


def most_stages_placed(stages: Sequence[Sequence[dict[str, float]]], nodes: Sequence[dict[str, float]]) -> int:
    """How many of ``stages`` (stage 0 first, the others alike) the nodes' resources ``nodes``
    hold, each stage whole on one node: stage 0 tried on every node, the rest counted per node."""
    first, rest = _total(stages[0]), [_total(s) for s in stages[1:]]
    best = 0
    for i, node in enumerate(nodes):
        if not _holds(node, first):
            continue
        if not rest:
            return 1
        rooms = [{k: v - first.get(k, 0.0) for k, v in n.items()} if j == i else n for j, n in enumerate(nodes)]
        best = max(best, 1 + min(len(rest), sum(_copies(room, rest[0]) for room in rooms)))
        if best == len(stages):
            break
    return best


def check_stages_fit(what: str, stages: Sequence[Sequence[dict[str, float]]], nodes: list[dict], num_layers: int = 0) -> None:
    """Raise PlacementError unless the alive nodes can hold every stage of ``stages``, each on one
    node (several stages may share one); the sentence names the model's layers when ``num_layers``
    is known, what a stage needs and what each node offers."""
    totals = [n["Resources"] for n in nodes if is_alive(n)]
    placed = most_stages_placed(stages, totals)
    if placed == len(stages):
        return
    first, other = _total(stages[0]), _total(stages[-1])
    names = list(dict.fromkeys([*first, *other]))
    layers = f"{num_layers} layers in {len(stages)} stages" if num_layers else f"{len(stages)} stages"
    needs = f"{_amounts(first, first)} (stage 0)"
    if len(stages) > 1:
        needs += f" and {_amounts(other, other)} (stage{' 1' if len(stages) == 2 else f's 1 to {len(stages) - 1}'})"
    offers = "; ".join(_amounts(node, names) for node in totals) or "nothing"
    raise PlacementError(
        f"{what} ({layers}) needs, for each stage on one node, {needs}, but the {len(totals)} alive nodes offer {offers}: "
        f"at most {placed} of its {len(stages)} stages fit"
    )


def _amounts(resources: dict[str, float], names: Sequence[str]) -> str:
    return ", ".join(f"{_fmt(resources.get(k, 0.0))} {k}" for k in names)


def check_fits(what: str, wanted: list[dict[str, float]], nodes: list[dict]) -> None:
    """Raise PlacementError unless one alive node's total resources hold every bundle of ``wanted``."""
    need: dict[str, float] = {}
    for bundle in wanted:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    totals = [n["Resources"] for n in nodes if is_alive(n)]
    if any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in totals):
        return
    largest = max(totals, key=lambda t: tuple(t.get(k, 0.0) for k in need), default={})
    needed = ", ".join(f"{_fmt(v)} {k}" for k, v in need.items())
    has = ", ".join(f"{_fmt(largest.get(k, 0.0))} {k}" for k in need)
    raise PlacementError(f"{what} needs {needed} on one node, but the largest node has {has} ({len(totals)} nodes alive)")


async def reserve_stages(
    what: str, stages: list[list[dict[str, float]]], timeout_s: float, node_id: str | None = None, name: str = "", num_layers: int = 0
) -> list[PlacementGroup]:
    """Ready, detached STRICT_PACK groups, one per stage of ``stages`` (stage 0's named ``name``,
    stage s's ``stage_group_name(name, s)``), reserved together; all on Ray node ``node_id`` when
    given. PlacementError, with every group released, if no set of nodes could hold the stages or
    they are not all ready within ``timeout_s``."""
    if len(stages) == 1:
        return [await reserve(what, stages[0], timeout_s, node_id, name)]
    nodes = await asyncio.to_thread(ray.nodes)
    if node_id is not None:
        what, nodes = f"{what} on node {node_id}", [n for n in nodes if n["NodeID"] == node_id and is_alive(n)]
        if not nodes:
            raise PlacementError(f"{what}: no such alive Ray node")
    check_stages_fit(what, stages, nodes, num_layers)
    selector = (lambda wanted: [{NODE_ID_LABEL: node_id} for _ in wanted]) if node_id is not None else (lambda wanted: None)
    groups = [
        placement_group(wanted, strategy="STRICT_PACK", name=stage_group_name(name, s) if name else "", lifetime="detached", bundle_label_selector=selector(wanted))
        for s, wanted in enumerate(stages)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(g.ready() for g in groups)), timeout_s)
    except asyncio.TimeoutError:
        release(groups)
        free = ray.available_resources()
        names = sorted({k for stage in stages for b in stage for k in b})
        raise PlacementError(
            f"{what}: its stages could not be placed within {timeout_s:.0f} s; free now: " + ", ".join(f"{_fmt(free.get(k, 0.0))} {k}" for k in names)
        ) from None
    except BaseException:  # cancelled (the controller is stopping): the caller never gets the groups to release
        release(groups)
        raise
    return groups


async def reserve(what: str, wanted: list[dict[str, float]], timeout_s: float, node_id: str | None = None, name: str = "") -> PlacementGroup:
    """A ready, detached STRICT_PACK placement group of ``wanted`` named ``name`` (on Ray node ``node_id`` when given);
    PlacementError if no node could hold it or it is not ready within ``timeout_s`` (others hold
    the resources)."""
    nodes = await asyncio.to_thread(ray.nodes)
    if node_id is not None:
        what, nodes = f"{what} on node {node_id}", [n for n in nodes if n["NodeID"] == node_id and is_alive(n)]
        if not nodes:
            raise PlacementError(f"{what}: no such alive Ray node")
    check_fits(what, wanted, nodes)
    selector = [{NODE_ID_LABEL: node_id} for _ in wanted] if node_id is not None else None
    group = placement_group(wanted, strategy="STRICT_PACK", name=name, lifetime="detached", bundle_label_selector=selector)
    try:
        await asyncio.wait_for(group.ready(), timeout_s)
    except asyncio.TimeoutError:
        remove_placement_group(group)
        free = ray.available_resources()
        names = sorted({k for b in wanted for k in b})
        raise PlacementError(
            f"{what}: its ranks could not be placed within {timeout_s:.0f} s; free now: "
            + ", ".join(f"{_fmt(free.get(k, 0.0))} {k}" for k in names)
        ) from None
    except BaseException:  # cancelled (the controller is stopping): the caller never gets the group to release
        remove_placement_group(group)
        raise
    return group


def actor_node_id(actor) -> str:
    """Run inside an actor (``handle.__ray_call__.remote(actor_node_id)``): the id of its Ray node."""
    return ray.get_runtime_context().get_node_id()


def release(group: PlacementGroup | Sequence[PlacementGroup] | None) -> None:
    """Remove a group, or each of a replica's groups."""
    if group is None:
        return
    for one in group if isinstance(group, (list, tuple)) else (group,):
        if one is not None:
            remove_placement_group(one)


def find(name: str) -> PlacementGroup | None:
    """The live placement group named ``name``; None when there is none."""
    try:
        return get_placement_group(name)
    except ValueError:  # Ray raises for a name it does not know
        return None


def find_replica_groups(name: str) -> list[PlacementGroup]:
    """The live groups of the replica whose (stage 0) group is named ``name``, stage 0's first."""
    groups = live_group_names()
    found = [groups[name]] if name in groups else []
    stages = {int(m.group(2)): g for n, g in groups.items() if (m := _STAGE_NAME.fullmatch(n)) and m.group(1) == name}
    return found + [stages[s] for s in sorted(stages)]


def live_group_names() -> dict[str, PlacementGroup]:
    """Name -> group of every named placement group not yet removed."""
    return {
        g["name"]: PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id)))
        for pg_id, g in placement_group_table().items()
        if g.get("name") and g.get("state") != "REMOVED"
    }


def _fmt(value: float) -> str:
    return f"{value:g}"
