"""Replica slots on the Ray nodes: how a pool is sized when its replicas follow the nodes.

On Kubernetes a pool is a KubeRay worker group: each worker pod runs one Ray node that
advertises ``splitserve_<pool>: 1`` (one replica slot), and the group's ``replicas`` is the
pool's size. The controller then keeps one replica per slot: it reads ``ray.nodes()``, counts
the slots of every alive node (leaving out the nodes being drained) and starts a replica,
pinned to its node, in every slot that holds none::

    ray.nodes()  ──>  node_slots(nodes, "splitserve_decode", draining)  ──>  {node a: 1, node b: 1}
    replicas (and starts) per node                                      ──>  {node a: 1}
    slots_to_fill(slots, used)                                          ──>  [node b]

Plain functions of plain data (``ray.nodes()`` dicts), so unit tests build the inputs directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def is_alive(node: Mapping) -> bool:
    """Whether Ray reports ``node`` (one ``ray.nodes()`` entry) alive."""
    return bool(node.get("Alive", node.get("alive")))


def alive_node_ids(nodes: Iterable[Mapping]) -> set[str]:
    """Ids of the nodes Ray reports alive."""
    return {n["NodeID"] for n in nodes if is_alive(n)}


def node_slots(nodes: Iterable[Mapping], resource: str, exclude: Iterable[str] = ()) -> dict[str, int]:
    """Alive node id -> whole replica slots of ``resource`` it offers; nodes offering none, and
    those in ``exclude`` (being drained), are left out. A fractional remainder is no slot."""
    excluded = set(exclude)
    slots = {}
    for node in nodes:
        if not is_alive(node) or node["NodeID"] in excluded:
            continue
        count = math.floor(node.get("Resources", {}).get(resource, 0.0) + 1e-9)
        if count > 0:
            slots[node["NodeID"]] = count
    return slots


def slots_to_fill(slots: Mapping[str, int], used: Mapping[str, int]) -> list[str]:
    """One node id per replica to start: each node's slots less the replicas it already holds
    or is starting (``used``), nodes in ``slots`` order. A node holding more than its slots
    (it shrank) gets none; removing the extra is not this function's job."""
    return [node_id for node_id, count in slots.items() for _ in range(count - used.get(node_id, 0))]
