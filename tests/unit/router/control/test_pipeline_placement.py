"""Placing a pipelined replica: one STRICT_PACK group per stage, their names, and the refusal of a
PP x TP shape that no set of nodes can hold (checked on ``ray.nodes()``-shaped data, no Ray)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from router.control import placement
from router.control.controller_config import ReplicaSpec
from router.control.launch import ClusterConfig
from router.errors import PlacementError

SLOT = "splitserve_decode"


def _node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": resources}


def test_each_stage_gets_its_own_bundles_the_leader_in_stage_0():
    stages = placement.stage_bundles(3, 2, 1.0, 0.5, SLOT)
    assert stages == [
        [{"CPU": 1.0, SLOT: 1.0}, {"CPU": 0.5}],
        [{"CPU": 0.5}, {"CPU": 0.5}],
        [{"CPU": 0.5}, {"CPU": 0.5}],
    ]
    assert placement.stage_bundles(2, 1, 1.0, 0.5, SLOT, gpus_per_rank=1.0) == [[{"CPU": 1.0, SLOT: 1.0, "GPU": 1.0}], [{"CPU": 0.5, "GPU": 1.0}]]
    assert placement.stage_bundles(1, 3, 1.0, 0.5, SLOT) == [placement.bundles(3, 1.0, 0.5, SLOT)]


def test_stage_groups_are_named_after_the_replica_and_lead_back_to_it():
    assert [placement.stage_group_name("splitserve-decode-3", s) for s in range(3)] == [
        "splitserve-decode-3", "splitserve-decode-3-stage-1", "splitserve-decode-3-stage-2",
    ]
    assert placement.replica_of_group("splitserve-decode-3-stage-2") == "splitserve-decode-3"
    assert placement.replica_of_group("splitserve-decode-3") == "splitserve-decode-3"


def test_the_leader_looks_stage_groups_up_by_the_names_the_controller_gives_them():
    from engine.parallel.ranks import stage_group_name

    for stage in range(4):
        assert stage_group_name("splitserve-prefill-12", stage) == placement.stage_group_name("splitserve-prefill-12", stage)


@pytest.mark.parametrize("nodes, placed", [
    ([{"CPU": 8.0, SLOT: 1.0}], 3),  # every stage on one node
    ([{"CPU": 2.0, SLOT: 1.0}, {"CPU": 1.0}, {"CPU": 1.0}], 3),  # one stage per node
    ([{"CPU": 1.0}, {"CPU": 2.5, SLOT: 1.0}], 3),  # stage 0 and one more on the second node, one on the first
    ([{"CPU": 2.0, SLOT: 1.0}, {"CPU": 0.9}, {"CPU": 5.0}], 3),  # the node too small for a stage is skipped
    ([{"CPU": 2.0, SLOT: 1.0}, {"CPU": 1.0}], 2),
    ([{"CPU": 8.0}], 0),  # no node has a slot of the pool: not even stage 0
])
def test_most_stages_placed_counts_whole_stages_per_node(nodes, placed):
    stages = placement.stage_bundles(3, 2, 1.0, 0.5, SLOT)
    assert placement.most_stages_placed(stages, nodes) == placed


def test_a_shape_no_node_set_holds_is_refused_with_the_layers_what_a_stage_needs_and_what_nodes_offer():
    stages = placement.stage_bundles(3, 2, 1.0, 0.5, SLOT)
    nodes = [_node("a", CPU=2.0, **{SLOT: 1.0}), _node("b", CPU=1.0), _node("dead", alive=False, CPU=64.0)]
    with pytest.raises(PlacementError) as refused:
        placement.check_stages_fit("a PP 3 x TP 2 decode replica", stages, nodes, num_layers=30)
    assert str(refused.value) == (
        "a PP 3 x TP 2 decode replica (30 layers in 3 stages) needs, for each stage on one node, 1.5 CPU, 1 splitserve_decode (stage 0) "
        "and 1 CPU (stages 1 to 2), but the 2 alive nodes offer 2 CPU, 1 splitserve_decode; 1 CPU, 0 splitserve_decode: at most 2 of its 3 stages fit"
    )
    placement.check_stages_fit("a PP 3 x TP 2 decode replica", stages, nodes + [_node("c", CPU=1.0)], num_layers=30)  # one node more: fits


def test_a_replica_spec_counts_stages_times_ranks_and_names_its_shape():
    spec = ReplicaSpec("decode", "m:C", (), tp_size=3, pp_size=2, num_layers=30)
    assert (spec.num_ranks, spec.shape) == (6, "PP 2 x TP 3")
    assert ReplicaSpec("decode", "m:C", (), tp_size=2, rank_kind="EP").shape == "EP 2"
    with pytest.raises(ValueError, match="pp_size: must be >= 1, got 0"):
        ReplicaSpec("decode", "m:C", (), pp_size=0)


def test_each_pool_gets_its_own_pp_size_into_its_engine_and_replica_spec():
    config = ClusterConfig(engine=EngineConfig(), num_prefill=1, prefill_pp_size=2, prefill_tp_size=3, decode_pp_size=3, num_layers=30)
    assert (config.pool_engine("prefill").pp_size, config.pool_engine("prefill").tp_size) == (2, 3)
    assert (config.pool_engine("decode").pp_size, config.pool_engine("decode").tp_size) == (3, 1)
    prefill, decode = config.replica_spec("prefill"), config.replica_spec("decode")
    assert (prefill.pp_size, prefill.tp_size, prefill.num_ranks, prefill.num_layers) == (2, 3, 6, 30)
    assert (decode.pp_size, decode.tp_size, decode.num_ranks) == (3, 1, 3)
    assert ClusterConfig(engine=EngineConfig(pp_size=2)).replica_spec("decode").pp_size == 2  # None takes the engine's
    with pytest.raises(ValueError, match="decode_pp_size: must be >= 1, got 0"):
        ClusterConfig(decode_pp_size=0)
