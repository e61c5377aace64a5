"""Pipeline parallelism: a replica's layers split into stages, hidden states passed stage to stage.

A replica of ``pp_size x tp_size`` ranks: rank ``s * tp_size + t`` is TP rank t of stage s. Stage
s holds a contiguous run of the layers (``stage_layers``: balanced by parameter bytes, the
embedding on the first stage, the final norm and LM head on the last) and the KV of those layers
only; its TP ranks split them as a replica of TP ``tp_size`` would (a ``TPGroup`` per stage).

One step of one micro-batch, on CPU over gloo (NCCL on GPUs)::

    leader (stage 0, TP 0) ──plan──► stage 0's TP ranks          (the stage's plan group)
    stage s, TP t ──(plan, hidden stream)──► stage s+1, TP t     (point to point, isend)
    last stage, TP 0 ──logits of the sampled rows──► leader      (point to point)

The plan travels with the activations, so a stage waits on nothing but its input: the leader
sends micro-batch k+1 into stage 0 while stage 1 still computes k (``LLMEngine`` keeps up to
``pp_size`` in flight). The hidden stream a stage hands on is the residual stream after its
last layer (the layer's output and its residual, added), which the next stage's first norm
would have added itself.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import UnsupportedModelError
from engine.model_config import ModelConfig
from engine.parallel.group import _PLAN_TIMEOUT, TPGroup, place_rank


@dataclass(frozen=True)
class Stage:
    """Which stage of how many this rank belongs to, and the layers that stage holds."""

    index: int
    size: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @classmethod
    def whole(cls, num_layers: int) -> Stage:
        """The one stage of a replica that is not pipelined."""
        return cls(0, 1, range(num_layers))


def layer_param_counts(config: ModelConfig) -> list[int]:
    """Parameters of each decoder layer at TP 1, counted on a model built on ``meta`` (no memory)."""
    from engine.models.decoder import DecoderLayer  # the model imports this package
    from engine.parallel.sharding import TPShard

    single = TPGroup.single()
    with torch.device("meta"):
        return [sum(p.numel() for p in DecoderLayer(config, i, TPShard(config), single, single).parameters()) for i in range(config.num_layers)]


def stage_layers(config: ModelConfig, pp_size: int) -> list[range]:
    """Contiguous runs of layers, one per stage, whose largest stage (counting the embedding on the
    first and the norm and LM head on the last, a tied one too) holds the fewest parameters."""
    check_pp_size("model", config, pp_size)
    layers = layer_param_counts(config)
    n = len(layers)
    vocab = config.vocab_size * config.hidden_size
    first_extra, last_extra = vocab, vocab + config.hidden_size
    prefix = [0]
    for count in layers:
        prefix.append(prefix[-1] + count)

    def cost(start: int, end: int, stage: int) -> int:
        return prefix[end] - prefix[start] + (first_extra if stage == 0 else 0) + (last_extra if stage == pp_size - 1 else 0)

    # best[k][i]: the smallest possible largest stage when stages 0..k hold layers [0, i)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp_size)]
    cut = [[0] * (n + 1) for _ in range(pp_size)]
    for i in range(1, n + 1):
        best[0][i] = cost(0, i, 0)
    for k in range(1, pp_size):
        for i in range(k + 1, n + 1):
            for j in range(k, i):
                value = max(best[k - 1][j], cost(j, i, k))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, end = [], n
    for k in range(pp_size - 1, 0, -1):
        start = cut[k][end]
        bounds.append(range(start, end))
        end = start
    bounds.append(range(0, end))
    return bounds[::-1]


def check_pp_size(model_name: str, config: ModelConfig, size: int) -> None:
    """Raise UnsupportedModelError unless each of ``size`` stages can hold at least one layer."""
    if size < 1:
        raise UnsupportedModelError(f"pp_size: must be >= 1, got {size}")
    if size > config.num_layers:
        raise UnsupportedModelError(
            f"model {model_name!r} has {config.num_layers} layers, fewer than pipeline parallel size {size}: "
            f"each stage holds at least one layer. Sizes that work: 1 to {config.num_layers}"
        )


class PipelineGroup:
    """This rank's place in a pipelined replica: its stage, its stage's ``TPGroup`` (``tp``) and the
    point-to-point links to the stages before and after it."""

    def __init__(self, rank: int, pp_size: int, tp_size: int, stage: Stage, tp: TPGroup, device: str, meta_group=None) -> None:
        self.rank = rank
        self.size = pp_size * tp_size
        self.pp_size = pp_size
        self.tp_size = tp_size
        self.stage = stage
        self.tp = tp
        self.device = device
        self._meta = meta_group
        self._sends: list[tuple[object, torch.Tensor]] = []
        """Sends in flight, each with its tensor (kept alive until it has gone)."""

    @classmethod
    def join(
        cls,
        rank: int,
        pp_size: int,
        tp_size: int,
        layers: Sequence[range],
        address: str,
        *,
        device: str = "cpu",
        gpu_ids: Sequence[str] = (),
        collective_timeout_s: float = 30.0,
    ) -> PipelineGroup:
        """Join the replica whose rank 0 listens at ``address``; blocks until all ``pp_size x
        tp_size`` ranks have joined. ``layers``: each stage's layers (``stage_layers``)."""
        size = pp_size * tp_size
        placed = place_rank(device, rank, gpu_ids)
        timeout = timedelta(seconds=collective_timeout_s)
        # The world group carries the stages' point-to-point sends; a stage waits on its input for
        # as long as the leader is idle, so its timeout is the plan group's.
        dist.init_process_group(placed.backend, init_method=f"tcp://{address}", rank=rank, world_size=size, timeout=_PLAN_TIMEOUT)
        stage_index, tp_rank = divmod(rank, tp_size)
        tp = TPGroup.single()
        for s in range(pp_size):  # every rank creates every group, in the same order
            ranks = list(range(s * tp_size, (s + 1) * tp_size))
            compute = dist.new_group(ranks, backend=placed.backend, timeout=timeout) if tp_size > 1 else None
            plan = dist.new_group(ranks, backend="gloo", timeout=_PLAN_TIMEOUT) if tp_size > 1 else None
            if s == stage_index and tp_size > 1:
                tp = TPGroup(tp_rank, tp_size, compute, plan, placed.device)
        meta = dist.new_group(list(range(size)), backend="gloo", timeout=_PLAN_TIMEOUT)  # plans and shapes: host bytes, on any device
        stage = Stage(stage_index, pp_size, layers[stage_index])
        return cls(rank, pp_size, tp_size, stage, tp, placed.device, meta)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp.rank

    def send_forward(self, plan: object, hidden: torch.Tensor | None) -> None:
        """Hand ``plan`` and this stage's hidden stream (None with a plan of None: stop) to the
        same TP rank of the next stage, without waiting for it to take them."""
        dst = self._peer(self.stage.index + 1)
        data = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8)
        shape = tuple(hidden.shape) if hidden is not None else (0, 0)
        self._send(torch.tensor([data.numel(), *shape], dtype=torch.int64), dst, self._meta)
        self._send(data, dst, self._meta)
        if hidden is not None and hidden.numel():
            self._send(hidden.contiguous(), dst)

    def recv_forward(self, dtype: torch.dtype) -> tuple[object, torch.Tensor | None]:
        """The previous stage's next ``(plan, hidden stream)``; blocks until it comes."""
        src = self._peer(self.stage.index - 1)
        header = torch.empty(3, dtype=torch.int64)
        dist.recv(header, src, group=self._meta)
        data = torch.empty(int(header[0]), dtype=torch.uint8)
        dist.recv(data, src, group=self._meta)
        plan = pickle.loads(data.numpy().tobytes())
        if plan is None:
            return None, None
        hidden = torch.empty((int(header[1]), int(header[2])), dtype=dtype, device=self.device)
        if hidden.numel():
            dist.recv(hidden, src)
        return plan, hidden

    def send_logits(self, logits: torch.Tensor) -> None:
        """Last stage's TP leader: one step's logits to the replica's leader."""
        self._send(torch.tensor(list(logits.shape), dtype=torch.int64), 0, self._meta)
        if logits.numel():
            self._send(logits.contiguous(), 0)

    def recv_logits(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Leader: the next step's logits from the last stage's TP leader (in the order sent)."""
        src = (self.pp_size - 1) * self.tp_size
        header = torch.empty(2, dtype=torch.int64)
        dist.recv(header, src, group=self._meta)
        logits = torch.empty((int(header[0]), int(header[1])), dtype=dtype, device=self.device)
        if logits.numel():
            dist.recv(logits, src)
        return logits

    def _send(self, tensor: torch.Tensor, dst: int, group=None) -> None:
        self._reap()
        self._sends.append((dist.isend(tensor, dst, group=group), tensor))

    def _reap(self) -> None:
        self._sends = [(work, tensor) for work, tensor in self._sends if not work.is_completed()]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        for work, _ in self._sends:
            work.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def join_replica(config, model_config: ModelConfig, rank: int, address: str, gpu_ids: Sequence[str] = ()) -> TPGroup | PipelineGroup:
    """Join the replica of ``config`` (an ``EngineConfig``) as ``rank``: its pipeline, when it has
    stages, else its tensor- or expert-parallel group."""
    if config.pp_size == 1:
        return TPGroup.join(rank, config.num_ranks, address, device=config.device, gpu_ids=gpu_ids, collective_timeout_s=config.tp_collective_timeout_s)
    return PipelineGroup.join(
        rank, config.pp_size, config.tp_size, stage_layers(model_config, config.pp_size), address,
        device=config.device, gpu_ids=gpu_ids, collective_timeout_s=config.tp_collective_timeout_s,
    )
