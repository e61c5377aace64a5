"""The controller's level-triggered decisions, as plain functions of what it wants and observes.

Each pass of the controller (router/control/controller.py), and its rebuild after a restart, compares a
pool's target with the replicas it observes and acts on the difference only, so running a pass
twice, or after a restart half-way through the last one, does no more than running it once::

    target 3, active [d0, d1], draining [d2, d3]  ->  undrain [d3]           (newest drain first)
    target 1, active [d0, d1, d2], draining []     ->  drain [d2, d1]         (newest first)
    target 3, active [d0], draining [], starting 1 ->  start 1

After a restart the controller sorts the replica actors it finds (``sort_observed``): a live
actor whose join was recorded is adopted; a live actor with no record was still starting when
the old controller died and is rolled back (stopped; the pass starts a fresh one if the pool
needs it); a record without a live actor is a replica that died meanwhile (replaced).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolPlan:
    """What one pass does to one pool."""

    undrain: tuple[str, ...]
    """Draining replicas taken back (the pool is below its target again)."""
    drain: tuple[str, ...]
    """Active replicas to drain (the pool is above its target), newest first."""
    num_to_start: int
    """Replicas to start."""


def plan_pool(target: int, active: Sequence[str], draining: Sequence[str], num_starting: int) -> PoolPlan:
    """The pass for one pool: ``active`` and ``draining`` replica ids oldest first (draining ones
    that may be taken back only), ``num_starting`` replicas being started now."""
    if target < 0:
        raise ValueError(f"target: must be >= 0, got {target}")
    undrain = tuple(draining[::-1][: max(0, target - len(active))])
    num_active = len(active) + len(undrain)
    drain = tuple(active[target:][::-1])
    return PoolPlan(undrain, drain, max(0, target - num_active - num_starting))


@dataclass(frozen=True)
class Observed:
    """The replica actors a restarted controller finds, sorted by what to do with them."""

    adopt: tuple[str, ...]
    """Live and recorded as joined: back in the map as they are."""
    roll_back: tuple[str, ...]
    """Live but never recorded as joined: a start the old controller did not finish; stopped."""
    lost: tuple[str, ...]
    """Recorded but not alive: died while no controller watched; forgotten (and replaced)."""


def sort_observed(live: Collection[str], recorded: Collection[str]) -> Observed:
    """Sort the live replica ids and the recorded ones (each sorted by id in the result)."""
    live, recorded = set(live), set(recorded)
    return Observed(tuple(sorted(live & recorded)), tuple(sorted(live - recorded)), tuple(sorted(recorded - live)))


def next_index(indexes: Collection[int], reserved: int = 0) -> int:
    """The first replica index above every observed one and at least ``reserved`` (ids are never reused)."""
    return max([reserved, *(i + 1 for i in indexes)])


def pinned_ports(grpc_address: str, http_url: str) -> Mapping[str, int]:
    """The ports a router listened on, from its status (``host:port``, ``scheme://host:port``), so
    its replacement listens there too; a part that is empty is left out."""
    ports = {}
    if grpc_address:
        ports["port"] = int(grpc_address.rsplit(":", 1)[1])
    if http_url:
        ports["http_port"] = int(http_url.rsplit(":", 1)[1].split("/", 1)[0])
    return ports
