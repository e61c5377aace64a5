"""Checks the router makes before a request reaches a worker (the engine checks the rest)."""

from __future__ import annotations

from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.errors import invalid


def check_generate(request: pb.GenerateRequest, config: RouterConfig, served_models: list[str]) -> None:
    """Raise CallRejected(INVALID_ARGUMENT) naming the field for a malformed request."""
    check_model(request.model, served_models)
    sources = [n for n, present in (
        ("prompt", request.HasField("prompt")),
        ("prompt_token_ids", len(request.prompt_token_ids) > 0),
        ("messages", len(request.messages) > 0),
    ) if present]
    if len(sources) > 1:
        raise invalid(sources[0], f"give exactly one of prompt, prompt_token_ids and messages (got {', '.join(sources)})")
    if not sources:
        raise invalid("prompt", "give one of prompt, prompt_token_ids and messages")
    check_prompt_size(request.prompt, request.messages, config)
    if len(request.prompt_token_ids) > config.max_prompt_token_ids:
        raise invalid("prompt_token_ids", f"{len(request.prompt_token_ids)} ids exceed the limit of {config.max_prompt_token_ids}")
    for i, message in enumerate(request.messages):
        if not message.role:
            raise invalid(f"messages[{i}].role", "must not be empty")
    if len(request.request_id) > 256:
        raise invalid("request_id", "longer than 256 characters")


def check_model(model: str, served_models: list[str]) -> None:
    """A named model must be served by a live decode replica; with none live (all being
    replaced) nothing is known to refuse, and the caller answers UNAVAILABLE instead."""
    if model and served_models and model not in served_models:
        raise invalid("model", f"{quoted(model)} is not served here (served: {', '.join(served_models) or 'none'})")


def quoted(value: str, max_chars: int = 64) -> str:
    """``value`` as an error message quotes it: cut to ``max_chars``, so that a huge field cannot
    push the status message past grpc's metadata limit (the client would get RESOURCE_EXHAUSTED)."""
    if len(value) <= max_chars:
        return repr(value)
    return f"{value[:max_chars]!r}... ({len(value)} characters)"


def check_prompt_size(prompt: str, messages, config: RouterConfig) -> None:
    """A chat message's role counts with its content: the chat template renders both."""
    num_chars = len(prompt) + sum(len(m.role) + len(m.content) for m in messages)
    if num_chars > config.max_prompt_chars:
        field = "prompt" if prompt else "messages"
        raise invalid(field, f"{num_chars} characters exceed the limit of {config.max_prompt_chars}")
