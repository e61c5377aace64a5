"""Linear layers and the vocabulary split over the ranks of a tensor-parallel group.

Each layer holds only its rank's slice of the weight and says where each checkpoint tensor's
slice lands (``weight_slices``), so the loader reads straight into the shards: no rank ever
holds a whole weight. At TP size 1 the slices are the whole tensors and every collective is the
identity, so the model code is the same at every size.

- ``ColumnParallelLinear`` splits the output features (QKV by heads, gate/up by intermediate
  width); the ranks' outputs are disjoint and nothing is exchanged.
- ``RowParallelLinear`` splits the input features (o_proj, down_proj): each rank computes a
  partial sum and one all-reduce adds them; the bias is added once, after it.
- ``VocabParallelEmbedding`` splits the vocabulary: a rank embeds the ids it holds, zeros the
  rest, and an all-reduce assembles the rows. ``ParallelLMHead`` computes its rank's logits and
  gathers them on the leader only, which samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.parallel.group import TPGroup

WeightSlice = tuple[torch.Tensor, tuple[slice, ...]]
"""(destination view in a parameter, index into the checkpoint tensor)."""


class _QuantizableLinear(torch.nn.Module):
    """A linear layer whose dense ``weight`` may be swapped for a quantized one after loading."""

    quantized = None
    """The weight in a quantized kernel's layout (``engine/quant/kernels.py``); None: ``weight`` is used."""
    output_promoted = False
    """Set by the owner when every use of the output promotes it exactly to the model dtype (a
    residual add, RoPE's multiplies): a bf16 kernel's result is then returned as it is, with the
    same values downstream and one cast fewer per call."""

    def use_weight(self, weight) -> None:
        """Compute with ``weight`` (anything with ``matmul(x) = x W^T``) and drop the dense parameter."""
        self.quantized = weight
        self.weight = None

    def project(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        """``x W^T`` for this rank's slice of W, without bias; ``cast_back`` False may leave it in the kernel's dtype."""
        return F.linear(x, self.weight) if self.quantized is None else self.quantized.matmul(x, cast_back)


class ColumnParallelLinear(_QuantizableLinear):
    """``y = x W^T (+ b)`` with this rank's rows of W, one run of rows per named part.

    ``parts`` lists the checkpoint tensors fused into the layer (``q``, ``k``, ``v``; ``gate``,
    ``up``; or one unnamed part) with the rows of each that this rank holds. A range may run
    past the tensor's end (a padded vocabulary): those rows stay unloaded and are never used.
    """

    def __init__(self, input_size: int, parts: Sequence[tuple[str | None, range]], bias: bool = False) -> None:
        super().__init__()
        self.parts = {name: rows for name, rows in parts}
        self._offsets: dict[str | None, int] = {}
        offset = 0
        for name, rows in parts:
            self._offsets[name] = offset
            offset += len(rows)
        self.weight = torch.nn.Parameter(torch.empty(offset, input_size))
        self.bias = torch.nn.Parameter(torch.empty(offset)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return F.linear(x, self.weight, self.bias)
        y = self.quantized.matmul(x, not self.output_promoted)
        return y if self.bias is None else y + self.bias

    def weight_slices(self, attr: str, part: str | None, shape: Sequence[int]) -> list[WeightSlice]:
        if part not in self.parts:
            raise KeyError(f"no part {part!r} in {list(self.parts)}")
        rows = self.parts[part]
        stop = min(rows.stop, shape[0])
        offset = self._offsets[part]
        dest = getattr(self, attr).data[offset : offset + max(0, stop - rows.start)]
        return [(dest, (slice(rows.start, stop),))]

    def loaded_numel(self, attr: str) -> int:
        return getattr(self, attr).numel()


class RowParallelLinear(_QuantizableLinear):
    """``y = all_reduce(x_r W_r^T) (+ b)`` where rank r holds input features ``columns`` of W."""

    def __init__(self, columns: range, output_size: int, tp: TPGroup, bias: bool = False) -> None:
        super().__init__()
        self.columns = columns
        self.tp = tp
        self.weight = torch.nn.Parameter(torch.empty(output_size, len(columns)))
        self.bias = torch.nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Partial sums are added across ranks in the model dtype.
        y = self.tp.all_reduce(self.project(x, cast_back=not self.output_promoted or self.tp.size > 1))
        return y if self.bias is None else y + self.bias

    def weight_slices(self, attr: str, part: str | None, shape: Sequence[int]) -> list[WeightSlice]:
        if attr == "bias":
            return [(self.bias.data, (slice(None),))]
        return [(self.weight.data, (slice(None), slice(self.columns.start, self.columns.stop)))]

    def loaded_numel(self, attr: str) -> int:
        return getattr(self, attr).numel()


class VocabParallelEmbedding(torch.nn.Module):
    """Token embeddings for the (padded) vocabulary rows ``rows``; the ranks' rows are summed."""

    def __init__(self, rows: range, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.rows = rows
        self.vocab_size = vocab_size
        self.tp = tp
        self.weight = torch.nn.Parameter(torch.empty(len(rows), hidden_size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        if self.tp.size > 1:
            hidden.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(hidden)

    def weight_slices(self, attr: str, part: str | None, shape: Sequence[int]) -> list[WeightSlice]:
        stop = min(self.rows.stop, shape[0])
        return [(self.weight.data[: max(0, stop - self.rows.start)], (slice(self.rows.start, stop),))]

    def loaded_numel(self, attr: str) -> int:
        real_rows = max(0, min(self.rows.stop, self.vocab_size) - self.rows.start)
        return real_rows * self.weight.shape[1]


class ParallelLMHead(ColumnParallelLinear):
    """The LM head over this rank's vocabulary rows; logits are gathered on the leader."""

    def __init__(self, rows: range, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__(hidden_size, [(None, rows)])
        self.vocab_size = vocab_size
        self.tp = tp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits ``[rows, vocab]`` on the leader; None on the other ranks."""
        full = self.tp.gather_to_leader(self.project(hidden), dim=-1)
        return None if full is None else full[:, : self.vocab_size].float()

    def loaded_numel(self, attr: str) -> int:
        rows = self.parts[None]
        return max(0, min(rows.stop, self.vocab_size) - rows.start) * self.weight.shape[1]
