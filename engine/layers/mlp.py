"""Feed-forward blocks: the gated SiLU MLP and the sparse mixture of experts built from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model_config import MoEConfig
from engine.parallel.group import TPGroup
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear


class GatedMLP(torch.nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection.

    ``intermediate`` is the slice of the intermediate width this rank holds: gate/up are
    column-split along it, down row-split with one all-reduce.
    """

    def __init__(self, hidden_size: int, intermediate: range, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [("gate", intermediate), ("up", intermediate)])
        self.down_proj = RowParallelLinear(intermediate, hidden_size, tp)
        self.down_proj.output_promoted = True  # added to the residual (or weighted, in a shared expert)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused`` (the device path): SiLU-and-multiply in one Triton kernel."""
        if fused:
            from engine.kernels.fused_norm import silu_and_mul  # Triton: only where the device path runs

            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(torch.nn.Module):
    """Top-k routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE), plus Qwen2-MoE's gated shared expert.

    Expert weights are stacked: ``w13[e]`` is expert e's ``[gate; up]`` and ``w2[e]`` its down
    projection, so one expert's work is two matmuls over the tokens routed to it.

    Under expert parallelism (``ep``, N ranks) this rank holds experts ``experts_held`` (1/N of
    them) and every rank routes its own tokens: each (token, expert) pair is sent to the rank
    owning the expert with one ``all_to_all`` (dispatch), computed there, and sent back with
    another (combine), where the weighted sum is taken. At EP 1 the exchanges are identities.
    The router, the shared expert and everything outside this block are replicated.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TPGroup, ep: TPGroup | None = None) -> None:
        super().__init__()
        self.ep = ep or TPGroup.single()
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.num_experts = moe.num_experts
        per_rank = moe.num_experts // self.ep.size
        self.experts_held = range(self.ep.rank * per_rank, (self.ep.rank + 1) * per_rank)
        size = moe.expert_intermediate_size
        self.gate = torch.nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.w13 = torch.nn.Parameter(torch.empty(per_rank, 2 * size, hidden_size))
        self.w2 = torch.nn.Parameter(torch.empty(per_rank, hidden_size, size))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: torch.nn.Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, range(moe.shared_expert_intermediate_size), tp)
            self.shared_expert_gate = torch.nn.Linear(hidden_size, 1, bias=False)
        self.register_buffer("expert_tokens", torch.zeros(per_rank, dtype=torch.long), persistent=False)
        """(token, expert) pairs each held expert has computed since start, from every rank's tokens."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, expert_ids)``, each ``[num_tokens, top_k]``."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        weights, expert_ids = self.route(x)
        out = self.experts(x, weights, expert_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, fused)
        return out

    def experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's routed experts, wherever they are held."""
        flat_experts = expert_ids.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # by expert, hence by owning rank
        token_of = order // self.top_k
        send_counts = torch.bincount(flat_experts // len(self.experts_held), minlength=self.ep.size)
        receive_counts = self.ep.exchange_counts(send_counts)
        sent, received = send_counts.tolist(), receive_counts.tolist()
        rows = self.ep.all_to_all(x[token_of], sent, received)
        row_experts = self.ep.all_to_all(flat_experts[order], sent, received) - self.experts_held.start
        computed = self.ep.all_to_all(self._held_experts(rows, row_experts), received, sent)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of, computed * weights.reshape(-1)[order, None])
        return out

    def _held_experts(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each row through held expert ``experts[i]``; rows grouped per expert first."""
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.w13.shape[0])
        self.expert_tokens += counts
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            picked = order[start : start + count]
            gate, up = F.linear(rows[picked], self.w13[expert]).chunk(2, dim=-1)
            out[picked] = F.linear(F.silu(gate) * up, self.w2[expert])
            start += count
        return out
