"""Find the request that makes a step raise (a "query of death"), so that it fails alone.

A step that raises is run again in halves, and each half that raises in halves again, until a
group of one request raises: that request is the culprit; the requests of every group that ran
through keep what that run sampled. One culprit among n requests costs about ``2 log2 n``
extra runs, paid only by a step that raised.

Running a chunk again is safe: a run only writes the K/V of the chunk's own positions, into the
request's own blocks (never a shared prefix block: those hold computed positions only), from
the same tokens, and sampling is counter-based (``engine/sampler.py``), so a run of a smaller
group samples what the whole batch would have. Nothing of the scheduler is committed before the
run returns (``Scheduler.update`` comes after), so a failed run leaves nothing to undo.

Running out of memory cannot be blamed on a request: it propagates. Whether culprits that make
up a whole step (or two steps in a row) point at the engine rather than at themselves is the
caller's rule (``LLMEngine._execute``, by their distinct inputs: ``inputs_of``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.request import Request, SampledTokens
from engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

RunChunks = Callable[[list[ScheduledChunk]], dict[Request, SampledTokens]]
"""Run a group of a step's chunks; the tokens sampled per request (``ModelRunner.execute``)."""


@dataclass(frozen=True)
class IsolatedStep:
    """A step's result once its failing requests are set apart."""

    sampled: dict[Request, SampledTokens]
    """Tokens sampled for the requests that ran through."""
    failed: dict[Request, Exception]
    """What each culprit raised when it ran alone."""


def blames_a_request(error: BaseException) -> bool:
    """Whether ``error`` may come from one request's data; running out of memory never does
    (a smaller group might pass, but the next step of the whole batch would run out again)."""
    return isinstance(error, Exception) and not isinstance(error, (MemoryError, torch.OutOfMemoryError))


def run_isolating(run: RunChunks, chunks: list[ScheduledChunk]) -> IsolatedStep:
    """``run(chunks)``; if it raises an error that may be a request's, the culprits found by
    running smaller groups."""
    try:
        return IsolatedStep(run(chunks), {})
    except Exception as error:
        if not blames_a_request(error):
            raise
        logger.warning("a step of %d requests raised %r; running it again in smaller groups to find the request", len(chunks), error)
        sampled: dict[Request, SampledTokens] = {}
        failed: dict[Request, Exception] = {}
        _split(run, chunks, error, sampled, failed)
        return IsolatedStep(sampled, failed)


def inputs_of(chunks: list[ScheduledChunk]) -> frozenset[tuple[int, ...]]:
    """The distinct inputs the chunks compute from: each request's tokens up to the chunk's last
    position (a verify chunk's drafts included)."""
    return frozenset(
        tuple(c.request.token_ids[: c.start + c.num_new_tokens - len(c.draft_token_ids)]) + tuple(c.draft_token_ids) for c in chunks
    )


def _split(run: RunChunks, chunks: list[ScheduledChunk], error: Exception, sampled: dict, failed: dict) -> None:
    """``chunks`` raised ``error``: one chunk alone is the culprit; more run again by halves,
    each half that raises split in turn."""
    if len(chunks) == 1:
        failed[chunks[0].request] = error
        return
    for half in _halves(chunks):
        try:
            sampled.update(run(half))
        except Exception as half_error:
            if not blames_a_request(half_error):
                raise
            _split(run, half, half_error, sampled, failed)


def _halves(chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
    middle = len(chunks) // 2
    return chunks[:middle], chunks[middle:]
