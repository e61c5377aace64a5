"""Sampling on the device, with fixed shapes and no host sync, so that it runs inside a CUDA graph.

Greedy, temperature, top-k and top-p per row, all rows through the same ops: the greedy token is
the argmax, a sampled one wins an exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` per
token, which draws token i with probability ``p_i``) over the filtered probabilities. The race's
uniforms come from a counter-based hash of (seed, output position, token id), computed with
integer ops on the device: no generator state, so a seeded request draws the same token for its
n-th output whatever else is in the batch, however the batch was padded, run after run and
whether the step was replayed from a graph or run eagerly.

Eager steps pass logits already processed by ``engine/logits.py`` (penalties, logit bias,
min_tokens, a constraint's mask: banned tokens at -inf, whose probability is 0 in the race);
a captured graph samples raw logits, so steps needing that processing never replay one.

These draws are not the CPU sampler's (``engine/sampler.py`` uses ``torch.multinomial`` on a
CPU generator seeded with ``step_seed``): on the device path a seeded request gets other tokens
than on the CPU path, from the same distribution. Greedy rows are the same on both.

The hash is 32-bit (lowbias32's multiply-xorshift rounds) kept inside int64 tensors: each
product's low 32 bits are exact even when the int64 product wraps, so CPU and CUDA agree bit for
bit. A uniform takes the hash's top 24 bits, as many as a float32 holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.params import SamplingParams

_MASK32 = 0xFFFFFFFF
_TOKEN_SALT = 0x9E3779B9
_POSITION_SALT = 0x85EBCA6B


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche of ``x`` (int64 holding values in ``[0, 2**32)``)."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``int64 [rows]`` a 32-bit key per (seed, output position): the stream a row draws from."""
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    return _mix32(low ^ _mix32(high ^ _mix32((positions & _MASK32) ^ _POSITION_SALT)))


def uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``float32 [rows, vocab]`` in (0, 1): token i of row r from ``hash(keys[r], i)``."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    bits = _mix32(keys[:, None] ^ _mix32(token_ids[None, :] ^ _TOKEN_SALT))
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class SamplingTensors:
    """One row per sampled logits row: what ``sample_on_device`` reads. Filled in place for a
    replayed graph (``fill``), or made for one eager step (``of``)."""

    temperatures: torch.Tensor
    """float32; 0 means greedy (``SamplingParams.is_greedy``)."""
    top_k: torch.Tensor
    """int64; 0 keeps every token."""
    top_p: torch.Tensor
    """float32 in (0, 1]."""
    seeds: torch.Tensor
    """int64, the request's seed."""
    positions: torch.Tensor
    """int64, output tokens the request had before this row's."""

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> SamplingTensors:
        """Static buffers for ``rows`` rows (greedy until filled)."""
        return cls(
            temperatures=torch.zeros(rows, dtype=torch.float32, device=device),
            top_k=torch.zeros(rows, dtype=torch.int64, device=device),
            top_p=torch.ones(rows, dtype=torch.float32, device=device),
            seeds=torch.zeros(rows, dtype=torch.int64, device=device),
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
        )

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], positions: list[int], device: torch.device) -> SamplingTensors:
        out = cls.empty(len(params), device)
        out.fill(params, seeds, positions)
        return out

    def fill(self, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> None:
        """Rows ``[0, len(params))`` from the requests; rows past them become greedy (graph padding)."""
        n = len(params)
        floats = torch.tensor([[0.0 if p.is_greedy else p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32)
        ints = torch.tensor([[p.top_k for p in params], [s & ((1 << 63) - 1) for s in seeds], positions], dtype=torch.int64)
        self.temperatures[:n].copy_(floats[0], non_blocking=True)
        self.top_p[:n].copy_(floats[1], non_blocking=True)
        self.top_k[:n].copy_(ints[0], non_blocking=True)
        self.seeds[:n].copy_(ints[1], non_blocking=True)
        self.positions[:n].copy_(ints[2], non_blocking=True)
        self.temperatures[n:].zero_()

    def head(self, rows: int) -> SamplingTensors:
        """The first ``rows`` rows, as views (a bucket of a graph's buffers)."""
        return SamplingTensors(*(t[:rows] for t in (self.temperatures, self.top_k, self.top_p, self.seeds, self.positions)))


def sample_on_device(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """``int64 [rows]``: one token per row of float32 ``logits [rows, vocab]``, with no host sync."""
    rows, vocab = logits.shape
    greedy = logits.argmax(dim=-1)
    temperatures = torch.where(sampling.temperatures > 0, sampling.temperatures, 1.0)
    ranked_logits, ranked_ids = torch.sort(logits / temperatures[:, None], dim=-1, descending=True)
    probs = torch.softmax(ranked_logits, dim=-1)
    ranks = torch.arange(vocab, device=logits.device)
    top_k = torch.where((sampling.top_k > 0) & (sampling.top_k < vocab), sampling.top_k, vocab)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    dropped = (ranks[None, :] >= top_k[:, None]) | (mass_before >= sampling.top_p[:, None])
    probs = probs.masked_fill(dropped, 0.0)
    noise = uniforms(row_keys(sampling.seeds, sampling.positions), vocab).gather(1, ranked_ids)
    race = probs / -torch.log(noise)
    sampled = ranked_ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(sampling.temperatures > 0, sampled, greedy)
