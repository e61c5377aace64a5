"""Runs of a step's tokens, each written into one block of the paged pool: what ``rope_write_kv`` takes.

``KVSegments`` is plain torch (no Triton), so the runner and the CUDA-graph buffers can build
it on any host: ``of_slots`` from per-token host lists for an eager step, ``decode`` over a
graph's static buffers, one token per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSegments:
    """Runs of a step's tokens, each written into one block: ``int32 [S]`` tensors on the pool's device.

    Run i covers rows ``token_starts[i] .. token_starts[i] + num_tokens[i] - 1`` of the step's
    flat batch (consecutive positions of one sequence) and slots ``offsets[i] ..`` of block
    ``block_ids[i]``; ``offsets + num_tokens <= block_size``. A negative block id marks a run
    to skip (padding rows of a CUDA-graph batch): its rows are neither rotated nor written.
    """

    block_ids: torch.Tensor
    """The block each run is written into; negative: skip the run."""
    token_starts: torch.Tensor
    """The run's first row in the step's flat batch."""
    offsets: torch.Tensor
    """The slot of the run's first token in its block."""
    num_tokens: torch.Tensor
    """Tokens in the run (>= 1)."""
    max_tokens: int
    """An upper bound of ``num_tokens``, known on the host: the kernel's tile height (1 for decode)."""

    def __post_init__(self) -> None:
        shape, device = self.block_ids.shape, self.block_ids.device
        for name in ("block_ids", "token_starts", "offsets", "num_tokens"):
            tensor = getattr(self, name)
            if tensor.dim() != 1 or tensor.shape != shape or tensor.dtype != torch.int32 or tensor.device != device:
                raise ValueError(
                    f"{name}: expected int32 {list(shape)} on {device} like block_ids, got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
                )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be a host int >= 1, got {self.max_tokens!r}")

    @property
    def num_segments(self) -> int:
        return self.block_ids.shape[0]

    @classmethod
    def of_slots(cls, block_ids: Sequence[int], offsets: Sequence[int], device: str | torch.device = "cpu") -> KVSegments:
        """The runs of per-token slots ``(block_ids[row], offsets[row])``, given as host lists.

        A run ends where the block changes or the offset does not follow on. Built on the host and
        copied to ``device`` in one transfer, so an eager step needs no device sync.
        """
        if len(block_ids) != len(offsets):
            raise ValueError(f"offsets: {len(offsets)} slots for {len(block_ids)} block ids")
        if any(offset < 0 for offset in offsets):
            raise ValueError(f"offsets: must be >= 0, got {list(offsets)}")
        runs: list[list[int]] = []  # [block_id, token_start, offset, num_tokens]
        for row, (block_id, offset) in enumerate(zip(block_ids, offsets)):
            if runs and runs[-1][0] == block_id and runs[-1][2] + runs[-1][3] == offset:
                runs[-1][3] += 1
            else:
                runs.append([block_id, row, offset, 1])
        written = [run[0] for run in runs if run[0] >= 0]
        if len(set(written)) != len(written):
            raise ValueError(f"block_ids: a block is written by two runs that do not follow on, got {list(block_ids)}")
        columns = torch.tensor(runs, dtype=torch.int32).reshape(-1, 4).t().contiguous().to(device)
        return cls(*columns.unbind(0), max_tokens=max((run[3] for run in runs), default=1))

    @classmethod
    def decode(cls, block_ids: torch.Tensor, offsets: torch.Tensor) -> KVSegments:
        """One token per row: row i goes to slot ``(block_ids[i], offsets[i])``.

        The segments hold ``block_ids`` and ``offsets`` themselves, not copies: a CUDA-graph
        runner builds them once over its static buffers and refills those in place each step.
        """
        for name, tensor in (("block_ids", block_ids), ("offsets", offsets)):
            if tensor.dtype != torch.int32 or tensor.dim() != 1:
                raise ValueError(f"{name}: expected int32 [batch] (held, not copied), got {tensor.dtype} {list(tensor.shape)}")
        batch = block_ids.shape[0]
        token_starts = torch.arange(batch, dtype=torch.int32, device=block_ids.device)
        return cls(block_ids, token_starts, offsets, torch.ones_like(token_starts), max_tokens=1)
