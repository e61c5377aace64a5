"""The process group of one tensor-parallel replica, and the few collectives the model needs.

Two groups join the same ranks:

- the compute group (gloo on CPU, NCCL on GPU) carries the all-reduces of the row-parallel
  layers, the all-to-alls of expert parallelism and the gather of logits. Its timeout is
  ``collective_timeout_s``: on gloo a rank that dies fails the step on every other rank at once
  (its sockets close); one that hangs, or dies under NCCL, fails it after the timeout. Either
  way the leader's engine thread raises and the replica is dead.
- the plan group (always gloo, on CPU) carries each step's plan from the leader. Followers
  wait on it between steps for as long as the leader is idle, so its timeout is long; a
  follower whose leader died is killed with it (Ray kills the actors an actor owns).

A replica of TP size 1 uses ``TPGroup.single()``: every collective is the identity, and no
process group exists.

Which device a rank computes on, and so which backend its compute group uses, is decided in one
place, ``rank_device``; the model code never asks.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_PLAN_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class RankDevice:
    """Where one rank of a replica computes, and how its compute group talks."""

    device: str
    """``cpu`` or ``cuda:N``: the rank's weights, KV pool and the tensors of its collectives."""
    backend: str
    """The compute group's torch.distributed backend: ``nccl`` on a GPU, ``gloo`` on the CPU."""


def rank_device(
    device: str, rank: int, *, num_gpus: int = 0, gpu_ids: Sequence[str] = (), visible_gpus: Sequence[str] | None = None
) -> RankDevice:
    """The device and backend of rank ``rank`` of a replica configured for ``device``.

    ``cpu``: every rank on the CPU, over gloo. ``cuda`` or ``cuda:N``: NCCL, each rank on a GPU of
    its own. That is the first of ``gpu_ids``, the GPUs Ray assigned to the rank's actor
    (``ray.get_gpu_ids()``), at its place among ``visible_gpus`` (``CUDA_VISIBLE_DEVICES``, None
    when unset): Ray narrows that to the assigned GPUs, so a rank's GPU is usually its
    ``cuda:0``. Processes that no one assigned GPUs (``gpu_ids`` empty) take ``cuda:N+rank``
    (N = 0 for ``cuda``). ``num_gpus`` is how many GPUs this process sees.
    """
    if rank < 0:
        raise ValueError(f"rank: must be >= 0, got {rank}")
    if device == "cpu":
        return RankDevice("cpu", "gloo")
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise ValueError(f"device: {device!r} is not cpu, cuda or cuda:N")
    if gpu_ids:
        assigned = str(gpu_ids[0])
        if visible_gpus is None:
            index = int(assigned)
        elif assigned in visible_gpus:
            index = list(visible_gpus).index(assigned)
        else:
            raise ValueError(f"gpu_ids: GPU {assigned} was assigned to rank {rank}, but CUDA_VISIBLE_DEVICES lists only {','.join(visible_gpus)}")
    else:
        index = int(match.group(1) or 0) + rank
    if index >= num_gpus:
        raise ValueError(f"device: rank {rank} of a {device} replica computes on cuda:{index}, but this process sees {num_gpus} GPUs")
    return RankDevice(f"cuda:{index}", "nccl")


def place_rank(device: str, rank: int, gpu_ids: Sequence[str] = ()) -> RankDevice:
    """This process's ``rank_device`` (the GPUs it sees, ``CUDA_VISIBLE_DEVICES``), made current
    on a GPU: NCCL binds each rank's communicator to the current device."""
    num_gpus = torch.cuda.device_count() if device != "cpu" else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    placed = rank_device(device, rank, num_gpus=num_gpus, gpu_ids=gpu_ids, visible_gpus=visible.split(",") if visible is not None else None)
    if placed.backend == "nccl":
        torch.cuda.set_device(placed.device)
    return placed


class TPGroup:
    """Rank ``rank`` of ``size`` in one replica's tensor-parallel group (of one pipeline stage's
    ranks, in a pipelined replica: ``engine/parallel/pipeline.py``; ranks here are the group's own)."""

    def __init__(self, rank: int, size: int, compute_group=None, plan_group=None, device: str | None = None) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        """This rank's device as ``join`` chose it (``rank_device``); None in ``single()``, whose
        engine computes where it is configured to."""
        self._compute = compute_group
        self._plan = plan_group

    @classmethod
    def single(cls) -> TPGroup:
        """The group of a replica that is not split: collectives do nothing."""
        return cls(0, 1)

    @classmethod
    def join(
        cls,
        rank: int,
        size: int,
        address: str,
        *,
        device: str = "cpu",
        gpu_ids: Sequence[str] = (),
        collective_timeout_s: float = 30.0,
    ) -> TPGroup:
        """Join the group whose rank 0 listens at ``address`` (``host:port``); blocks until all
        ``size`` ranks have joined. Every rank passes the replica's configured ``device``, and
        the GPUs Ray assigned to it as ``gpu_ids`` (``rank_device`` places it; ``self.device``)."""
        if size == 1:
            return cls.single()
        placed = place_rank(device, rank, gpu_ids)
        timeout = timedelta(seconds=collective_timeout_s)
        dist.init_process_group(placed.backend, init_method=f"tcp://{address}", rank=rank, world_size=size, timeout=timeout)
        compute = dist.group.WORLD
        plan = dist.new_group(backend="gloo", timeout=_PLAN_TIMEOUT)
        return cls(rank, size, compute, plan, placed.device)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self._compute)
        return tensor

    def gather_to_leader(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """The ranks' ``tensor``s concatenated along ``dim`` on the leader; None on the others."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_leader else None
        dist.gather(tensor, parts, group_dst=0, group=self._compute)
        return torch.cat(parts, dim=dim) if self.is_leader else None

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int], receive_counts: list[int]) -> torch.Tensor:
        """Rows ``tensor[sum(send_counts[:r]) : ...]`` go to rank r; returns the rows every rank
        sent here, in rank order (``receive_counts[r]`` from rank r)."""
        if self.size == 1:
            return tensor
        out = tensor.new_empty((sum(receive_counts), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), receive_counts, send_counts, group=self._compute)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """``int64 [size]``: how many rows each rank will send here, given how many this rank sends each."""
        if self.size == 1:
            return send_counts
        out = torch.empty_like(send_counts)
        dist.all_to_all_single(out, send_counts, group=self._compute)
        return out

    def send_plan(self, plan: object) -> None:
        """Leader: hand ``plan`` to every other rank (``None`` tells them to stop)."""
        if self.size > 1:
            dist.broadcast_object_list([plan], group_src=0, group=self._plan)

    def receive_plan(self) -> object:
        """Follower: the leader's next plan; blocks until it comes."""
        box = [None]
        dist.broadcast_object_list(box, group_src=0, group=self._plan)
        return box[0]

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank passes (every rank calls it, in the same order as the
        plans): how many of a batch of block loads every rank completed."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._plan)
        return int(tensor.item())

    def barrier(self) -> None:
        """Wait until every rank has come here (no timeout but the plan group's)."""
        if self.size > 1:
            dist.barrier(group=self._plan)

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def free_address(host: str) -> str:
    """``host:port`` with a port free on ``host`` now, for rank 0 to listen on."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"
