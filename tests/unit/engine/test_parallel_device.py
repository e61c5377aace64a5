"""Which device each rank of a replica computes on and which backend its collectives use: decided
in one function (engine/parallel/group.py:rank_device), used by TPGroup.join and build_shard."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from engine.build import shard_device
from engine.config import EngineConfig
from engine.parallel.group import RankDevice, TPGroup, free_address, rank_device
from engine.parallel.ranks import gpus_per_rank


@pytest.mark.parametrize(
    "device, rank, num_gpus, gpu_ids, visible, expected",
    [
        ("cpu", 0, 0, (), None, RankDevice("cpu", "gloo")),
        ("cpu", 3, 8, ("5",), "5", RankDevice("cpu", "gloo")),  # GPUs around change nothing
        ("cuda", 0, 4, (), None, RankDevice("cuda:0", "nccl")),
        ("cuda", 1, 4, (), None, RankDevice("cuda:1", "nccl")),  # processes started by hand: a GPU per rank
        ("cuda:2", 1, 4, (), None, RankDevice("cuda:3", "nccl")),  # counted from N
        ("cuda", 1, 1, ("6",), "6", RankDevice("cuda:0", "nccl")),  # Ray narrowed CUDA_VISIBLE_DEVICES to the rank's GPU
        ("cuda", 1, 4, ("2",), "0,1,2,3", RankDevice("cuda:2", "nccl")),  # the node's GPUs visible: the assigned one's place
        ("cuda", 1, 4, ("3",), None, RankDevice("cuda:3", "nccl")),  # no CUDA_VISIBLE_DEVICES: the id is the index
    ],
)
def test_each_rank_gets_its_device_and_backend(device, rank, num_gpus, gpu_ids, visible, expected):
    visible_gpus = visible.split(",") if visible is not None else None
    assert rank_device(device, rank, num_gpus=num_gpus, gpu_ids=gpu_ids, visible_gpus=visible_gpus) == expected


@pytest.mark.parametrize(
    "device, rank, num_gpus, gpu_ids, visible, message",
    [
        ("tpu", 0, 0, (), None, "device: 'tpu' is not cpu, cuda or cuda:N"),
        ("cuda", -1, 2, (), None, "rank: must be >= 0, got -1"),
        ("cuda", 1, 1, (), None, "device: rank 1 of a cuda replica computes on cuda:1, but this process sees 1 GPUs"),
        ("cuda:1", 0, 0, (), None, "device: rank 0 of a cuda:1 replica computes on cuda:1, but this process sees 0 GPUs"),
        ("cuda", 0, 2, ("7",), "0,1", "gpu_ids: GPU 7 was assigned to rank 0, but CUDA_VISIBLE_DEVICES lists only 0,1"),
    ],
)
def test_a_rank_without_its_gpu_is_refused_by_name(device, rank, num_gpus, gpu_ids, visible, message):
    with pytest.raises(ValueError) as e:
        rank_device(device, rank, num_gpus=num_gpus, gpu_ids=gpu_ids, visible_gpus=visible.split(",") if visible else None)
    assert str(e.value) == message


def test_a_shard_computes_where_its_group_placed_it():
    cpu, cuda = EngineConfig(), EngineConfig(device="cuda:1", weights="fp32")
    single = TPGroup.single()
    assert (shard_device(cpu, single, single), shard_device(cuda, single, None)) == ("cpu", "cuda:1")
    joined = TPGroup(1, 2, device="cuda:0")  # rank 1 on the GPU Ray gave it
    assert (shard_device(cuda, joined, single), shard_device(cuda, single, joined)) == ("cuda:0", "cuda:0")
    with pytest.raises(ValueError, match=r"device: this rank joined its group on cpu, but the replica runs on cuda:1; every rank passes"):
        shard_device(cuda, TPGroup(1, 2, device="cpu"), single)


def test_ranks_of_a_cuda_replica_ask_ray_for_a_gpu_each():
    assert (gpus_per_rank(EngineConfig()), gpus_per_rank(EngineConfig(device="cuda", weights="fp32"))) == (0.0, 1.0)


def _rank_main(rank: int, address: str, device: str, out) -> None:
    group = TPGroup.join(rank, 2, address, device=device, collective_timeout_s=20)
    x = torch.full((3,), float(rank + 1), device=group.device)
    group.all_reduce(x)
    out.put((rank, group.device, dist.get_backend(group._compute), x.tolist()))
    group.close()


def _join_two_ranks(device: str) -> list[tuple]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    address = free_address("127.0.0.1")
    ranks = [ctx.Process(target=_rank_main, args=(r, address, device, out)) for r in range(2)]
    for p in ranks:
        p.start()
    results = sorted(out.get(timeout=60) for _ in ranks)
    for p in ranks:
        p.join(timeout=30)
    return results


def test_two_cpu_ranks_join_over_gloo_on_the_cpu():
    assert _join_two_ranks("cpu") == [(0, "cpu", "gloo", [3.0, 3.0, 3.0]), (1, "cpu", "gloo", [3.0, 3.0, 3.0])]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks need two GPUs")
def test_two_cuda_ranks_join_over_nccl_each_on_its_gpu():
    assert _join_two_ranks("cuda") == [(0, "cuda:0", "nccl", [3.0, 3.0, 3.0]), (1, "cuda:1", "nccl", [3.0, 3.0, 3.0])]
