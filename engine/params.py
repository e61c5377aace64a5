"""Per-request sampling and stopping parameters, validated where they are made."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError

GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this pick the most likely token. Dividing logits by a smaller one can
overflow float32 to inf, and softmax then yields NaN probabilities, which fail the engine step
(and the engine loop with it); sampling at a temperature going to 0 tends to the argmax anyway."""


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1
