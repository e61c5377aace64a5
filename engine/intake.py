"""A request's prompt, checked at the door: one of text, token ids or chat messages, every id
in the vocabulary, and prompt plus output within the context and the KV pool. Each refusal is an
``InvalidRequestError`` naming the field, so the worker answers INVALID_ARGUMENT and nothing is
scheduled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class PromptIntake:
    tokenizer: Tokenizer
    model_name: str
    """For the chat template (``Tokenizer.chat_prompt_ids``)."""
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    """Blocks of one data-parallel rank's pool: a request never spans two."""

    def prompt_token_ids(self, prompt: str | Sequence[int] | None, messages: Sequence[dict[str, str]] | None) -> list[int]:
        if prompt is not None and messages is not None:
            raise InvalidRequestError("prompt", "give either prompt or messages, not both")
        if messages is not None:
            if not messages:
                raise InvalidRequestError("messages", "must not be empty")
            return self.tokenizer.chat_prompt_ids(messages, self.model_name)
        if prompt is None:
            raise InvalidRequestError("prompt", "give a prompt or messages")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise InvalidRequestError("prompt_token_ids", "must not be empty")
        return self.token_ids_in_vocab("prompt_token_ids", prompt)

    def token_ids_in_vocab(self, field: str, token_ids: Sequence[int]) -> list[int]:
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(field, f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        return list(token_ids)

    def check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{len(prompt_token_ids)} tokens do not fit the context of {self.max_model_len} tokens"
            )
        max_len = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        needed = -(-max_len // self.block_size)
        if needed > self.num_kv_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt plus max_tokens needs {needed} KV blocks but the pool holds {self.num_kv_blocks}",
            )
