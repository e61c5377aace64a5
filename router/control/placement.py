"""Placing a tensor-parallel replica: one placement group per replica, its ranks on one node.

A replica of TP size N is N processes that exchange activations every layer, so they must share
a node: a STRICT_PACK placement group of N bundles, the leader in bundle 0 (with the replica's
own CPUs and its pool's slot) and follower rank r in bundle r (``tp_rank_cpus`` each, or one
GPU each where the replica runs on GPUs). Before asking Ray for it, the controller checks that
some node could hold it at all, so an impossible size fails at once with a sentence saying what
is needed and what exists, instead of a placement group that waits forever. When the controller
follows the nodes (Kubernetes), the group is pinned to one node by the ``ray.io/node-id`` label
Ray gives every node.

Groups are detached and named after their replica (``splitserve-decode-3``): a group an actor
creates dies with it otherwise, and the ranks in it with the group, so a controller's death would
take every multi-rank replica down. A restarted controller finds a replica's group by that name
(``find``), and removes the groups of replicas that never finished starting (``orphans``).
"""

from __future__ import annotations

import asyncio

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, placement_group_table, remove_placement_group

from router.control.node_slots import is_alive
from router.errors import PlacementError

NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node, holding its id: a placement group's bundles select a node by it."""


def bundles(tp_size: int, leader_cpus: float, rank_cpus: float, pool_resource: str, gpus_per_rank: float = 0.0) -> list[dict[str, float]]:
    """The placement group's bundles: the leader's first, then one per follower rank."""
    leader = {"CPU": leader_cpus, pool_resource: 1.0}
    rank = {"CPU": rank_cpus}
    if gpus_per_rank:
        leader["GPU"] = rank["GPU"] = gpus_per_rank
    return [{k: v for k, v in leader.items() if v}] + [{k: v for k, v in rank.items() if v} for _ in range(tp_size - 1)]


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


def release(group: PlacementGroup | None) -> None:
    if group is not None:
        remove_placement_group(group)


def find(name: str) -> PlacementGroup | None:
    """The live placement group named ``name``; None when there is none."""
    try:
        return get_placement_group(name)
    except ValueError:  # Ray raises for a name it does not know
        return None


def live_group_names() -> dict[str, PlacementGroup]:
    """Name -> group of every named placement group not yet removed."""
    return {
        g["name"]: PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id)))
        for pg_id, g in placement_group_table().items()
        if g.get("name") and g.get("state") != "REMOVED"
    }


def _fmt(value: float) -> str:
    return f"{value:g}"
