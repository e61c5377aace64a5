"""The process group of one tensor-parallel replica, and the few collectives the model needs.

Two groups join the same ranks:

- the compute group (gloo on CPU, NCCL on GPU) carries the all-reduces of the row-parallel
  layers and the gather of logits. Its timeout is ``collective_timeout_s``: a rank that dies
  fails the step on every other rank at once (its sockets close), one that hangs fails it
  after the timeout. Either way the leader's engine thread raises and the replica is dead.
- the plan group (always gloo, on CPU) carries each step's plan from the leader. Followers
  wait on it between steps for as long as the leader is idle, so its timeout is long; a
  follower whose leader died is killed with it (Ray kills the actors an actor owns).

A replica of TP size 1 uses ``TPGroup.single()``: every collective is the identity, and no
process group exists.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

_PLAN_TIMEOUT = timedelta(days=365)


class TPGroup:
    """Rank ``rank`` of ``size`` in one replica's tensor-parallel group."""

    def __init__(self, rank: int, size: int, compute_group=None, plan_group=None) -> None:
        self.rank = rank
        self.size = size
        self._compute = compute_group
        self._plan = plan_group

    @classmethod
    def single(cls) -> TPGroup:
        """The group of a replica that is not split: collectives do nothing."""
        return cls(0, 1)

    @classmethod
    def join(cls, rank: int, size: int, address: str, *, backend: str = "gloo", collective_timeout_s: float = 30.0) -> TPGroup:
        """Join the group whose rank 0 listens at ``address`` (``host:port``); blocks until all ``size`` ranks have joined."""
        if size == 1:
            return cls.single()
        timeout = timedelta(seconds=collective_timeout_s)
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size, timeout=timeout)
        compute = dist.group.WORLD
        plan = dist.new_group(backend="gloo", timeout=_PLAN_TIMEOUT)
        return cls(rank, size, compute, plan)

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
        dist.gather(tensor, parts, dst=0, group=self._compute)
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
            dist.broadcast_object_list([plan], src=0, group=self._plan)

    def receive_plan(self) -> object:
        """Follower: the leader's next plan; blocks until it comes."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._plan)
        return box[0]

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
