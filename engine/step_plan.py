"""What every rank of a replica needs to run one step: the scheduler's chunks as plain ids and
positions (``StepPlan``), with no request objects, so that it crosses process boundaries (the
plan channel of a tensor- or expert-parallel replica, the stages of a pipelined one)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.logits import PromptSpan, prompt_span
from engine.request import Request
from engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class PlannedChunk:
    """One sequence's tokens in a step: positions ``[start, start + num_tokens)``."""

    start: int
    num_tokens: int
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    """The sequence's blocks up to and including the one holding its last token of the step."""


@dataclass(frozen=True)
class StepPlan:
    """What every rank needs to run one step: decode chunks (sorted by position) then prefill chunks."""

    decodes: tuple[PlannedChunk, ...]
    prefills: tuple[PlannedChunk, ...]
    sample_rows: tuple[int, ...]
    """Rows of the flat batch whose logits are sampled."""
    prompt_rows: tuple[int, ...] = ()
    """Rows whose logits give prompt log-probabilities (``params.prompt_logprobs``); computed before the sample rows'."""

    @property
    def logit_rows(self) -> tuple[int, ...]:
        return self.prompt_rows + self.sample_rows

    @classmethod
    def of(cls, chunks: list[ScheduledChunk], block_size: int) -> tuple[StepPlan, list[tuple[Request, tuple[int, ...]]], list[PromptSpan]]:
        """The plan of the scheduler's ``chunks``; the requests its sample rows belong to with the
        drafts each verifies (one row each, or ``1 + k`` for a verify chunk of k drafts); and the
        prompt positions whose log-probabilities its prompt rows give, in order."""
        decodes = sorted((c for c in chunks if c.num_new_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in chunks if c.num_new_tokens > 1]
        rows, prompt_rows, sampled, spans, num_tokens = [], [], [], [], 0
        for chunk in decodes + prefills:
            span = prompt_span(chunk.request, chunk.start, chunk.num_new_tokens)
            if span is not None:
                prompt_rows += range(num_tokens + span.start - chunk.start, num_tokens + span.start - chunk.start + span.num_positions)
                spans.append(span)
            num_tokens += chunk.num_new_tokens
            if chunk.num_sample_rows:
                rows += range(num_tokens - chunk.num_sample_rows, num_tokens)
                sampled.append((chunk.request, chunk.draft_token_ids))
        plan = cls(
            decodes=tuple(_planned(c, block_size) for c in decodes),
            prefills=tuple(_planned(c, block_size) for c in prefills),
            sample_rows=tuple(rows),
            prompt_rows=tuple(prompt_rows),
        )
        return plan, sampled, spans


def _planned(chunk: ScheduledChunk, block_size: int) -> PlannedChunk:
    end = chunk.start + chunk.num_new_tokens
    known_end = end - len(chunk.draft_token_ids)
    return PlannedChunk(
        start=chunk.start,
        num_tokens=chunk.num_new_tokens,
        token_ids=tuple(chunk.request.token_ids[chunk.start : known_end]) + chunk.draft_token_ids,
        block_ids=tuple(chunk.request.block_ids[: -(-end // block_size)]),
    )


@dataclass(frozen=True)
class Launched:
    """A pipelined step on its way through the stages: its plan, the requests its sample rows
    belong to (with the drafts each verifies) and its prompt log-probability spans."""

    plan: StepPlan
    requests: list[tuple[Request, tuple[int, ...]]]
    spans: list[PromptSpan]
