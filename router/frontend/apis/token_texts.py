"""Token ids as text for the answers' log-probabilities, with the model's own tokenizer: the
router holds it already (router.routing.tokenization), fetched from a decode worker once."""

from __future__ import annotations

from typing import Protocol

from router.errors import CallRejected
from router.frontend.apis.errors import APIError, from_rejected
from router.frontend.service import GenerationService
from router.routing.worker_calls import WorkerDied


class TokenTexts(Protocol):
    """What of the model's tokenizer (``engine.tokenizer.Tokenizer``) log-probabilities need."""

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class TokenStrings:
    """Token ids to text and bytes, remembered for one answer."""

    def __init__(self, tokenizer: TokenTexts | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            if self._tokenizer is None:
                found = (f"token_id:{token_id}", [])
            else:
                found = (self._tokenizer.token_text(token_id), list(self._tokenizer.token_bytes(token_id)))
            self._cache[token_id] = found
        return found


async def model_tokenizer(service: GenerationService, model: str):
    """The model's tokenizer in this router (fetched from a decode worker on first use); an
    APIError (503, or the load's refusal) when there is none to fetch it from."""
    replica = service.directory.pick("decode", model)
    if replica is None:
        raise APIError(503, "no live decode worker", code="unavailable")
    try:
        return await service.tokenizers.tokenizer(replica)
    except CallRejected as rejected:
        raise from_rejected(rejected) from rejected
    except WorkerDied as e:
        raise APIError(503, f"decode worker {replica.replica_id} died: {e}", code="unavailable") from e
