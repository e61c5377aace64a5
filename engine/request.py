"""A request's state inside the engine, and what the engine reports about it each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.params import SamplingParams
from engine.stop import StopStringMatcher
from engine.structured.matcher import GrammarMatcher
from engine.tokenizer import IncrementalDetokenizer
from kv_store.keys import block_keys


class FinishReason(str, enum.Enum):
    """Why a request ended."""

    STOP = "stop"
    """EOS, a stop token or a stop string."""
    LENGTH = "length"
    """max_tokens or the model's context length."""
    ABORT = "abort"
    """Cancelled by the caller."""


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability where it was sampled (or, for a prompt token, where it
    followed), and the ``top`` most likely tokens there as (token id, log-probability), most
    likely first. Log-softmax of the logits the sampler drew from: after penalties, logit bias,
    the constraint's mask and temperature (temperature 1 for a greedy request)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampledTokens:
    """What one step sampled for one request (``ModelRunner.execute``): a token, or one per row of
    a verify chunk (row j is output token n + j, drawn after drafts 0..j-1)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """One per token where the request asks for log-probabilities (``params.logprobs``), else None."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"logprobs: {len(self.logprobs)} for {len(self.token_ids)} tokens")


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    """The stop string or stop token id that ended the request, if any."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache at admission."""
    num_output_tokens: int
    trace: RequestTrace | None = None
    """On the last output: when the request passed each point on its way to its first token."""
    logprobs: tuple[TokenLogprobs, ...] = ()
    """``params.logprobs`` set: one per ``new_token_ids`` entry."""
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    """``params.prompt_logprobs`` set, on the first output only: prompt tokens 1.. (token 0 has none)."""

    @property
    def queue_s(self) -> float | None:
        """On the last output: seconds from the request's arrival (``add_request``, or the
        ``arrival_s`` it was given) to the step that first scheduled it (for a remote prefill, to
        the moment its KV joined the batch); None before."""
        if self.trace is None or self.trace.first_scheduled_s is None:
            return None
        return self.trace.first_scheduled_s - self.trace.arrival_s


@dataclass(frozen=True)
class RequestTrace:
    """A request's way to its first token, in ``time.monotonic`` seconds of the engine's process.
    The gaps between them are where its time to first token went::

        arrival_s          reached the worker (``EngineRequest.arrival_s``)
          pickup           the engine thread finishing the step it was running
        admitted_s         the engine thread took the request in, between two steps
          wait             steps that ran without it (no free slot, other prompts first)
        first_scheduled_s  the step that first ran its tokens began
          prefill          the steps computing its prompt (for a remote prefill: none)
        first_token_s      the step that sampled its first token ended

    The prefill's steps and the tokens they computed for the whole batch tell a slower step
    from more work: two runs of one request compare by their prefill time per step token.
    """

    arrival_s: float
    admitted_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    prefill_steps: int = 0
    """Steps that ran its tokens up to its first (one, unless chunked or preempted; none for a remote prefill)."""
    prefill_step_tokens: int = 0
    """Tokens those steps computed, its own and the rest of each batch's."""


@dataclass(frozen=True)
class EngineRequest:
    """Arguments for ``LLMEngine.add_request``, validated."""

    request_id: str
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    tenant_salt: str | None
    arrival_s: float = field(default_factory=time.monotonic)
    """When the request reached the worker (``time.monotonic``): its queue time starts here, so
    the wait for the engine thread to pick it up (up to a whole step) counts too."""
    resume_token_ids: tuple[int, ...] = ()
    """Output another replica already streamed (a migrated request): see ``LLMEngine.add_request``."""


@dataclass(eq=False)
class Request:
    """One sequence: its tokens, its blocks, how far its KV is computed, and its stop state."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    root_key: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    detokenizer: IncrementalDetokenizer
    seed: int
    """Its samples' seed: output token n is drawn with ``sampler.step_seed(seed, n)``."""
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by output: the sequence whose KV is being computed."""
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Leading tokens whose K/V is in the cache."""
    num_registered_blocks: int = 0
    """Leading blocks already offered to the prefix cache."""
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    hold_kv: bool = False
    """Lease the prompt's blocks when the request finishes (a prefill whose KV is shipped next)."""
    dp_rank: int | None = None
    """The data-parallel rank whose KV pool holds its blocks (expert-parallel replicas); None until admission picks one."""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    admitted_s: float = field(default_factory=time.monotonic)
    """When the engine took the request in (built by ``add_request`` on the engine's thread)."""
    first_scheduled_s: float | None = None
    """When a step first ran this request's tokens (``time.monotonic``)."""
    first_token_s: float | None = None
    """When the output carrying its first token was taken (the end of the step that sampled it)."""
    prefill_steps: int = 0
    prefill_step_tokens: int = 0
    """See RequestTrace."""
    draft_token_ids: tuple[int, ...] = ()
    """Speculative drafts to verify this step after its last token (set by the speculator, never
    part of ``token_ids``: only the accepted ones are appended)."""
    grammar: GrammarMatcher | None = None
    """Its constraint's matcher (``params.constraint``), advanced with every output token."""
    num_forced_tokens: int = 0
    """Output tokens the constraint forced, appended without a forward pass each (jump-forward)."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self._stop_strings = StopStringMatcher(self.params.stop)
        self._pending_tokens: list[int] = []
        self._pending_text: list[str] = []
        self._pending_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        """Prompt tokens 1.. recorded so far (``params.prompt_logprobs``), across chunks; never twice."""
        self._prompt_logprobs_sent = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Asks for prompt log-probabilities and some prompt token's are not recorded yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, first_token_index: int, logprobs: list[TokenLogprobs]) -> None:
        """Record the log-probabilities of prompt tokens ``first_token_index, ...``; those already
        recorded (a chunk computed again after a preemption) are skipped."""
        skip = len(self.prompt_logprobs) + 1 - first_token_index
        if skip < 0:
            raise ValueError(f"prompt logprobs from token {first_token_index}: tokens 1..{len(self.prompt_logprobs)} are recorded")
        self.prompt_logprobs += logprobs[skip:]

    def keys_of_full_blocks(self, block_size: int, num_blocks: int) -> list[int]:
        """The first ``num_blocks`` block keys, hashing only blocks not hashed before."""
        if len(self.block_keys) < num_blocks:
            parent = self.block_keys[-1] if self.block_keys else self.root_key
            tokens = self.token_ids[: num_blocks * block_size]
            self.block_keys += block_keys(tokens, block_size, parent, start_block=len(self.block_keys))
        return self.block_keys[:num_blocks]

    def resume(self, token_ids: list[int]) -> None:
        """Take ``token_ids`` as output already generated and streamed (by a replica that died
        mid-request): the detokenizer, stop strings and constraint pick up after them, they count
        toward ``max_tokens``, and nothing of them is emitted again. Their KV is computed with the
        prompt's. Raises ValueError if one of them would have ended the request, or breaks the
        request's constraint."""
        for index, token_id in enumerate(token_ids):
            self.append_token(token_id)
            if self.finished:
                raise ValueError(f"output token {index} ({token_id}) would have finished the request ({self.finish_reason.value})")
        self._pending_tokens, self._pending_text, self._pending_logprobs = [], [], []

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """Add a sampled token (with its log-probabilities, where the request asks) and decide
        whether the request is finished."""
        params = self.params
        if self.grammar is not None and not self.grammar.accept(token_id):
            raise ValueError(f"token {token_id} does not continue an answer its {params.constraint.field} allows")
        self.token_ids.append(token_id)
        self._pending_tokens.append(token_id)
        if logprobs is not None:
            self._pending_logprobs.append(logprobs)
        if token_id in params.stop_token_ids or (token_id in self.eos_token_ids and not params.ignore_eos):
            self._finish(FinishReason.STOP, token_id)
            return
        text, matched = self._stop_strings.add(self.detokenizer.add_tokens([token_id]))
        self._pending_text.append(text)
        if matched is not None:
            self._finish(FinishReason.STOP, matched, flush=False)
        elif self.grammar is not None and self.grammar.is_finished:
            self._finish(FinishReason.STOP)
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= self.max_model_len:
            self._finish(FinishReason.LENGTH)

    def jump_forward(self) -> int:
        """Append the tokens the constraint forces next (SGLang's jump-forward), as output, and
        return how many: the next step computes their KV together with the last sampled token,
        one forward pass for all of them instead of one each. Their log-probability is 0 (the
        constrained distribution leaves nothing else), each its own only alternative."""
        num_forced = 0
        while self.grammar is not None and not self.finished and (forced := self.grammar.forced_tokens()):
            for token_id in forced:
                logprobs = None
                if self.params.logprobs is not None:
                    logprobs = TokenLogprobs(token_id, 0.0, ((token_id, 0.0),) if self.params.logprobs else ())
                self.append_token(token_id, logprobs)
                num_forced += 1
                if self.finished:
                    break
        self.num_forced_tokens += num_forced
        return num_forced

    def abort(self) -> None:
        self._finish(FinishReason.ABORT)

    def take_output(self) -> RequestOutput:
        """The tokens and text produced since the last call."""
        if self._pending_tokens and self.first_token_s is None:
            self.first_token_s = time.monotonic()
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=tuple(self._pending_tokens),
            text_delta="".join(self._pending_text),
            finished=self.finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=self.num_output_tokens,
            trace=self._trace() if self.finished else None,
            logprobs=tuple(self._pending_logprobs),
            prompt_logprobs=self._take_prompt_logprobs() if self._pending_tokens else (),
        )
        self._pending_tokens, self._pending_text, self._pending_logprobs = [], [], []
        return out

    def _take_prompt_logprobs(self) -> tuple[TokenLogprobs, ...]:
        if self._prompt_logprobs_sent or self.params.prompt_logprobs is None:
            return ()
        self._prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)

    def _trace(self) -> RequestTrace:
        return RequestTrace(self.arrival_s, self.admitted_s, self.first_scheduled_s, self.first_token_s, self.prefill_steps, self.prefill_step_tokens)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None = None, flush: bool = True) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if flush:
            tail, _ = self._stop_strings.add(self.detokenizer.flush())
            self._pending_text.append(tail + self._stop_strings.flush())
