"""Which slice of a model each tensor-parallel rank holds, and which TP sizes a model allows.

Attention heads are split evenly; KV heads are split too when there are at least as many as
ranks, and replicated otherwise (each rank holds the one KV head its query heads read, as vLLM
does). The MLP's intermediate width and the vocabulary are split in contiguous runs (the
vocabulary padded up to a multiple of the size).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.errors import UnsupportedModelError
from engine.model_config import ModelConfig


def tp_size_problems(config: ModelConfig, size: int) -> list[str]:
    """Why ``config`` cannot be split over ``size`` ranks; empty when it can."""
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads do not divide by {size}")
    elif config.num_kv_heads % size and size % config.num_kv_heads:
        problems.append(f"{config.num_kv_heads} KV heads neither divide by {size} nor divide it")
    if config.moe is None and config.intermediate_size % size:
        problems.append(f"intermediate size {config.intermediate_size} does not divide by {size}")
    if config.moe is not None and size > 1:
        problems.append("mixture-of-experts models run with TP 1 (their experts are split by expert parallelism)")
    return problems


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Every TP size the model can be split over (1 always works)."""
    return [s for s in range(1, config.num_heads + 1) if not tp_size_problems(config, s)]


def check_tp_size(model_name: str, config: ModelConfig, size: int) -> None:
    """Raise UnsupportedModelError naming the model, its head counts and the sizes that work."""
    if size < 1:
        raise UnsupportedModelError(f"tp_size: must be >= 1, got {size}")
    problems = tp_size_problems(config, size)
    if problems:
        sizes = ", ".join(str(s) for s in valid_tp_sizes(config))
        raise UnsupportedModelError(
            f"model {model_name!r} ({config.num_heads} attention heads, {config.num_kv_heads} KV heads) "
            f"cannot run with tensor parallel size {size}: {'; '.join(problems)}. Sizes that work: {sizes}"
        )


def check_ep_size(model_name: str, config: ModelConfig, size: int) -> None:
    """Raise UnsupportedModelError unless ``config``'s experts split evenly over ``size`` ranks."""
    if size == 1:
        return
    if config.moe is None:
        raise UnsupportedModelError(f"model {model_name!r} ({config.architecture}) has no experts: expert parallelism needs a mixture-of-experts model; run it with ep_size 1")
    experts = config.moe.num_experts
    if experts % size:
        sizes = ", ".join(str(s) for s in range(1, experts + 1) if experts % s == 0)
        raise UnsupportedModelError(f"model {model_name!r} has {experts} experts, which do not divide by expert parallel size {size}. Sizes that work: {sizes}")


def split(total: int, size: int, rank: int) -> range:
    """Rank ``rank``'s contiguous share of ``total`` items split evenly (``total % size == 0``)."""
    per_rank = total // size
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass(frozen=True)
class TPShard:
    """The slice of one model that rank ``rank`` of ``size`` holds."""

    config: ModelConfig
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: {self.rank} is not a rank of size {self.size}")

    @property
    def heads(self) -> range:
        """The model's attention heads this rank computes."""
        return split(self.config.num_heads, self.size, self.rank)

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold the same KV head (1 unless there are fewer KV heads than ranks)."""
        return max(1, self.size // self.config.num_kv_heads)

    @property
    def kv_heads(self) -> range:
        """The model's KV heads this rank holds (its slice of the paged KV pool)."""
        if self.kv_replicas > 1:
            head = self.rank // self.kv_replicas
            return range(head, head + 1)
        return split(self.config.num_kv_heads, self.size, self.rank)

    @property
    def owns_kv_heads(self) -> bool:
        """Whether this rank is the first of the ranks holding its KV heads (the one that ships them)."""
        return self.rank % self.kv_replicas == 0

    @property
    def intermediate(self) -> range:
        return split(self.config.intermediate_size, self.size, self.rank)

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.config.vocab_size // self.size) * self.size

    @property
    def vocab(self) -> range:
        """Rows of the (padded) vocabulary this rank's embedding and LM head hold."""
        return split(self.padded_vocab_size, self.size, self.rank)


def rank_fields(rank: int, model, node_ip: str, alive: bool) -> dict:
    """The fields of splitserve.v1.TPRank for this process, which holds ``model``."""
    return dict(
        rank=rank,
        node_ip=node_ip,
        pid=os.getpid(),
        alive=alive,
        param_bytes=parameter_bytes(model),
        kv_head_start=model.shard.kv_heads.start,
        kv_head_end=model.shard.kv_heads.stop,
    )


def parameter_bytes(model) -> int:
    """Bytes of the parameters ``model`` holds (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
