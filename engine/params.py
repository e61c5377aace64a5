"""Per-request sampling and stopping parameters, validated where they are made."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError

GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this pick the most likely token. Dividing logits by a smaller one can
overflow float32 to inf, and softmax then yields NaN probabilities, which fail the engine step
(and the engine loop with it); sampling at a temperature going to 0 tends to the argmax anyway."""


MAX_LOGPROBS = 20
"""The most top alternatives a request may ask for per token (OpenAI's cap)."""


class ConstraintKind(str, enum.Enum):
    """What a constrained answer must match."""

    JSON_OBJECT = "json_object"
    """Any JSON object."""
    JSON_SCHEMA = "json_schema"
    """A JSON value valid against ``Constraint.spec`` (a JSON Schema, as text)."""
    REGEX = "regex"
    """The whole answer matches ``Constraint.spec``."""
    CHOICE = "choice"
    """The answer is exactly one of ``Constraint.choices``."""
    GRAMMAR = "grammar"
    """The answer is a sentence of the grammar ``Constraint.spec``, written in ``Constraint.syntax``."""


GRAMMAR_SYNTAXES = ("lark", "ebnf")


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint: every sampled token keeps the answer a prefix of a
    sentence the constraint allows, and the answer ends (finish reason STOP) when the constraint
    is complete and allows nothing more. Compiled and checked by ``engine.structured``."""

    kind: ConstraintKind
    spec: str = ""
    """The JSON Schema, regex or grammar source (empty for JSON_OBJECT and CHOICE)."""
    choices: tuple[str, ...] = ()
    """CHOICE only: the strings allowed."""
    syntax: str = "lark"
    """GRAMMAR only: "lark" or "ebnf" (GBNF, as llama.cpp writes it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ConstraintKind(self.kind))
        object.__setattr__(self, "choices", tuple(self.choices))
        field = f"constraint.{self.kind.value}"
        if self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.REGEX, ConstraintKind.GRAMMAR) and not self.spec:
            raise InvalidRequestError(field, "must not be empty")
        if self.kind is ConstraintKind.CHOICE and (not self.choices or any(not isinstance(c, str) or not c for c in self.choices)):
            raise InvalidRequestError(field, "give one or more non-empty strings")
        if self.kind is ConstraintKind.GRAMMAR and self.syntax not in GRAMMAR_SYNTAXES:
            raise InvalidRequestError("constraint.grammar.syntax", f"must be one of {', '.join(GRAMMAR_SYNTAXES)}, got {self.syntax!r}")

    @property
    def field(self) -> str:
        """The request field that carries it, for error messages."""
        return f"constraint.{self.kind.value}"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` (or below ``GREEDY_BELOW_TEMPERATURE``) is greedy. ``top_k == 0`` and
    ``top_p == 1`` disable those filters.
    """

    max_tokens: int = 16
    """Most tokens to generate (the context length may end generation first)."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or anything below GREEDY_BELOW_TEMPERATURE) picks the most likely token."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    seed: int | None = None
    """Seeds this request's samples (one seed per output position), so they do not depend on other requests."""
    stop: tuple[str, ...] = ()
    """Generation ends when the output text contains any of these; the stop string is cut off."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends after any of these tokens (in addition to the model's EOS)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""
    presence_penalty: float = 0.0
    """In [-2, 2]: subtracted from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """In [-2, 2]: subtracted from a token's logit once per time it is in the output."""
    repetition_penalty: float = 1.0
    """> 0; 1 is off: the logit of a token in the prompt or output is divided by it when
    positive and multiplied by it when negative (CTRL's, as vLLM and HF apply it)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs, bias in [-100, 100], added to the logits before anything else."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` cannot be sampled before this many output tokens."""
    logprobs: int | None = None
    """None: off. Else each output token's log-probability and this many top alternatives (0..MAX_LOGPROBS)."""
    prompt_logprobs: int | None = None
    """None: off. Else each prompt token's log-probability and this many top alternatives (0..MAX_LOGPROBS)."""
    constraint: Constraint | None = None
    """None: free text."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError("seed", f"must be an integer, got {self.seed!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "stop token ids must be integers >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value!r}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise InvalidRequestError("repetition_penalty", f"must be > 0 (1 is off), got {self.repetition_penalty!r}")
        bias = tuple((int(t), float(b)) for t, b in (self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias))
        object.__setattr__(self, "logit_bias", bias)
        for token_id, value in bias:
            if token_id < 0:
                raise InvalidRequestError("logit_bias", f"token ids must be >= 0, got {token_id}")
            if not -100 <= value <= 100:
                raise InvalidRequestError("logit_bias", f"bias of token {token_id} must be in [-100, 100], got {value!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether its logits change before sampling (penalties, logit bias, min_tokens, a constraint)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            or self.logit_bias or self.min_tokens or self.constraint is not None
        )
