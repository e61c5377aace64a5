"""`--prefill-pp` / `--decode-pp`: from the command line into each pool's engine config, the
refusal of a size above the model's layers before anything starts, and `status`'s stage lines."""

from __future__ import annotations

from cli import main as cli
from cli.client_commands import stage_lines
from proto import splitserve_pb2 as pb


def _args(*argv: str):
    return cli.build_parser().parse_args(["up", *argv])


def test_pp_flags_reach_each_pools_engine_with_the_models_layers(tiny_llama_dir):
    config = cli._cluster_config(_args("--model", str(tiny_llama_dir), "--decode-pp", "2", "--prefill-pp", "2", "--prefill-tp", "2"), num_prefill=1)
    assert (config.pool_engine("decode").pp_size, config.pool_engine("decode").tp_size) == (2, 1)
    assert (config.pool_engine("prefill").pp_size, config.pool_engine("prefill").tp_size) == (2, 2)
    assert config.num_layers == 2  # the tiny Llama's, named if the replicas cannot be placed
    assert config.replica_spec("prefill").num_ranks == 4
    plain = cli._cluster_config(_args("--model", str(tiny_llama_dir)))
    assert (plain.pool_engine("decode").pp_size, plain.num_layers) == (1, 0)  # nothing pipelined: the model is not read


def test_the_engines_pp_size_is_no_option_of_its_own():
    options = {flag for action in cli.build_parser()._subparsers._group_actions[0].choices["up"]._actions for flag in action.option_strings}
    assert {"--prefill-pp", "--decode-pp"} <= options
    assert "--pp-size" not in options


def test_a_pp_size_above_the_layers_is_refused_before_anything_starts(tiny_llama_dir, capsys):
    assert cli.main(["up", "--model", str(tiny_llama_dir), "--decode-pp", "3"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (
        f"splitserve up: --decode-pp: model {tiny_llama_dir.name!r} has 2 layers, fewer than pipeline parallel size 3: "
        "each stage holds at least one layer. Sizes that work: 1 to 2\n"
    )


def _rank(rank: int, stage: int, layers: tuple[int, int], heads: tuple[int, int], alive: bool = True, busy_s: float = 0.0) -> pb.TPRank:
    return pb.TPRank(
        rank=rank, node_ip=f"10.0.0.{stage + 1}", pid=100 + rank, alive=alive, stage=stage, layer_start=layers[0], layer_end=layers[1],
        kv_head_start=heads[0], kv_head_end=heads[1], busy_s=busy_s,
    )


def test_status_shows_each_stage_its_layers_node_busy_time_and_ranks():
    replica = pb.ReplicaStatus(
        replica_id="decode-0", pool="decode", pp_size=2, tp_size=2,
        tp_ranks=[
            _rank(0, 0, (0, 16), (0, 1), busy_s=1.25), _rank(1, 0, (0, 16), (1, 2), busy_s=1.5),
            _rank(2, 1, (16, 30), (0, 1), busy_s=2.0), _rank(3, 1, (16, 30), (1, 2), alive=False),
        ],
    )
    assert stage_lines(replica) == [
        "pp 2 x tp 2",
        "  stage 0: layers 0-16 on 10.0.0.1, busy 1.5 s (ranks 0: pid 100 alive heads 0-1, 1: pid 101 alive heads 1-2)",
        "  stage 1: layers 16-30 on 10.0.0.2, busy 2.0 s (ranks 2: pid 102 alive heads 0-1, 3: pid 103 DEAD heads 1-2)",
    ]
    single = pb.ReplicaStatus(pp_size=2, tp_size=1, tp_ranks=[_rank(0, 0, (0, 1), (0, 2))])
    assert stage_lines(single) == ["pp 2 x tp 1", "  stage 0: layers 0-1 on 10.0.0.1, busy 0.0 s (ranks 0: pid 100 alive)", "  stage 1: no rank reported"]
