"""The controller's level-triggered decisions (router/control/reconcile.py) and its vocabulary of names."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.control.controller_config import ControllerConfig, RouterSpec, parse_replica_name, replica_actor_name
from router.control.reconcile import Observed, PoolPlan, next_index, pinned_ports, plan_pool, sort_observed


@pytest.mark.parametrize(
    ("target", "active", "draining", "starting", "plan"),
    [
        (2, ["d0", "d1"], [], 0, PoolPlan((), (), 0)),
        (3, ["d0", "d1"], ["d2", "d3"], 0, PoolPlan(("d3",), (), 0)),  # the newest drain comes back first
        (1, ["d0", "d1", "d2"], [], 0, PoolPlan((), ("d2", "d1"), 0)),  # the newest go first
        (3, ["d0"], [], 1, PoolPlan((), (), 1)),  # one already starting counts
        (4, ["d0"], ["d1"], 0, PoolPlan(("d1",), (), 2)),
        (0, ["d0"], ["d1"], 0, PoolPlan((), ("d0",), 0)),
        (1, [], [], 3, PoolPlan((), (), 0)),  # more starting than wanted: nothing more starts
    ],
)
def test_a_pass_acts_only_on_the_difference(target, active, draining, starting, plan):
    assert plan_pool(target, active, draining, starting) == plan


def test_a_pass_run_again_on_its_outcome_does_nothing():
    first = plan_pool(1, ["d0", "d1", "d2"], ["d3"], 0)
    assert first == PoolPlan((), ("d2", "d1"), 0)
    assert plan_pool(1, ["d0"], ["d1", "d2", "d3"], 0) == PoolPlan((), (), 0)


def test_a_negative_target_is_refused_by_name():
    with pytest.raises(ValueError, match="target: must be >= 0, got -1"):
        plan_pool(-1, [], [], 0)


def test_a_restarted_controller_adopts_the_joined_stops_the_half_started_and_forgets_the_lost():
    live = ["decode-0", "decode-2", "prefill-1"]
    recorded = ["decode-0", "decode-1", "prefill-1"]
    assert sort_observed(live, recorded) == Observed(adopt=("decode-0", "prefill-1"), roll_back=("decode-2",), lost=("decode-1",))


def test_replica_ids_are_never_reused():
    assert next_index([]) == 0
    assert next_index([0, 3, 1]) == 4
    assert next_index([0, 1], reserved=7) == 7  # an id handed out before (its replica since gone) stays used


def test_a_replacement_router_listens_on_the_ports_of_the_dead_one():
    assert pinned_ports("127.0.0.1:40123", "http://127.0.0.1:40124") == {"port": 40123, "http_port": 40124}
    assert pinned_ports("[::1]:50051", "") == {"port": 50051}


def test_actor_names_of_replicas_and_routers():
    assert replica_actor_name("decode-3") == "splitserve-decode-3"
    assert parse_replica_name("splitserve-decode-3") == ("decode", 3)
    assert parse_replica_name("splitserve-prefill-12") == ("prefill", 12)
    for other in ("splitserve-router-0", "splitserve-controller", "splitserve-decode-x", "decode-3"):
        assert parse_replica_name(other) is None


def test_router_specs_and_controller_configs_refuse_bad_input_by_name():
    with pytest.raises(ValueError, match="router_id: must not be empty"):
        RouterSpec("", RouterConfig())
    with pytest.raises(ValueError, match="router_id: 'decode-1' is a worker replica's id"):
        RouterSpec("decode-1", RouterConfig())
    with pytest.raises(ValueError, match="actor_class: 'RouterReplica' is not module:Class"):
        RouterSpec("router-0", RouterConfig(), actor_class="RouterReplica")
    with pytest.raises(ValueError, match="drain_timeout_s: must be >= 0, got -1"):
        ControllerConfig(drain_timeout_s=-1)
