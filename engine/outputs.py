"""What the engine hands out: its stats, the records of remote prefills, finished requests."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import FinishReason


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's queues and KV pool."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_cached_kv_blocks: int
    num_preemptions: int
    num_aborted_requests: int
    num_computed_prompt_tokens: int
    num_parked: int = 0
    """Requests waiting for their prompt KV from a prefill worker."""
    num_leases: int = 0
    """KV transfers that may still touch this pool's blocks."""
    num_queued_prefill_tokens: int = 0
    """Prompt tokens not yet computed, over waiting and running requests (the prefill backlog)."""
    num_steps: int = 0
    """Steps that computed tokens."""
    num_step_tokens: int = 0
    """Tokens those steps computed (prompt chunks and decode tokens)."""
    step_s: float = 0.0
    """Wall time spent in those steps."""
    step_cpu_s: float = 0.0
    """CPU time of the stepping thread in those steps. ``step_s - step_cpu_s`` is time the thread
    was not running inside a step: waiting for the GIL (another thread of the process holds it),
    for a core (preempted), or for its OpenMP team where the team's threads sleep. Alone on its
    cores with the GIL to itself, a step's wall and CPU time agree to a few tenths of a ms."""
    num_draft_tokens: int = 0
    """Speculative draft tokens verified by the target model."""
    num_accepted_draft_tokens: int = 0
    """Of those, the ones accepted (each saved a decode step)."""
    num_failed_requests: int = 0
    """Requests dropped because a step raised for them alone (``LLMEngine.take_failures``)."""
    num_forced_tokens: int = 0
    """Output tokens a constraint forced, appended without a forward pass each (jump-forward)."""
    num_grammar_compiles: int = 0
    """Constraints compiled (cache misses), since start."""
    grammar_compile_s: float = 0.0
    """Wall seconds those compiles took."""


@dataclass(frozen=True)
class RemotePrefill:
    """Where a parked request's prompt KV must be written (``add_remote_request``)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    first_block: int
    """Index of the first prompt block to fill; the blocks before it are this pool's cached prefix."""
    block_ids: tuple[int, ...]
    """This pool's blocks for prompt blocks ``first_block, first_block + 1, ...``; leased."""
    num_cached_tokens: int
    dp_rank: int = 0
    """The data-parallel rank whose pool ``block_ids`` belong to (expert-parallel replicas)."""


@dataclass(frozen=True)
class PrefilledKV:
    """A finished prefill-only request (``hold_kv``) whose prompt blocks stay leased until shipped."""

    request_id: str
    first_token: int
    block_ids: tuple[int, ...]
    """Every prompt block, in order (the last one may be partly filled)."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens this engine found in its own prefix cache."""


@dataclass(frozen=True)
class Completion:
    """A finished request, as returned by ``LLMEngine.generate``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    num_cached_tokens: int
