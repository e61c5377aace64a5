"""OpenAI request bodies -> ``splitserve.v1.GenerateRequest``: pure functions, no I/O.

Each check raises APIError naming the field as the client wrote it. Fields are read, not
declared: a field this module does not know is ignored (clients add vendor extensions), but a
field of the OpenAI API that would change the output and that splitserve cannot honour
(``echo``, ``best_of`` > 1, ``suffix``, ...) is refused rather than silently dropped. Sampling
features and structured outputs: openai_sampling.py; tools: openai_tools.py.
Extensions that vLLM also accepts: ``top_k``, ``ignore_eos``, ``stop_token_ids``. splitserve's
own, for resuming an answer whose router died (the gRPC API's ``GenerateRequest.resume``):
``return_resume: true`` makes every streamed chunk carry ``resume`` (the chunk's new token ids,
the tag of every id so far, and, on the first, the seed), and ``resume: {"token_ids": [...],
"tag": "..."}`` (every id received, the last tag; with ``seed`` set to the reported one) goes on
after them.
"""

from __future__ import annotations

import base64
import dataclasses
import binascii
from collections.abc import Mapping
from dataclasses import dataclass

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import APIError, invalid
from router.frontend.apis.openai_sampling import (
    DEFAULT_MAX_N, apply_sampling_fields, chat_logprobs, completion_logprobs, constraint_from, integer, number,
)
from router.frontend.apis.openai_tools import ToolPlan, message_tool_calls, parse_tools

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's documented default for /v1/completions; chat defaults to the rest of the context."""

_INT32_MAX = 2**31 - 1
"""Largest value of the proto's int32 fields (max_tokens, top_k, stop_token_ids)."""

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
"""Roles a chat template renders; ``developer`` is OpenAI's newer name for ``system``."""

_UNSUPPORTED = {
    # field: the value that means "not used" (anything else is refused)
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "prediction": (None,),
}


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed completions or chat request."""

    generate: pb.GenerateRequest
    model: str
    """The model id as the client named it (echoed in responses)."""
    stream: bool
    include_usage: bool
    """``stream_options.include_usage``: a last chunk carries the usage."""
    return_resume: bool = False
    """Chunks carry what a resume needs (token ids, tag, seed)."""
    num_choices: int = 1
    """``n``: the samples, each a choice with its index."""
    logprobs: int | None = None
    """None: no log-probabilities; else the top alternatives each token carries."""
    constraint_field: str | None = None
    """The field that constrains the answer (``response_format``, ``structured_outputs.regex``,
    ``tool_choice``), to name in the engine's refusal of a bad schema, regex or grammar."""
    tools: ToolPlan | None = None
    """How the answer's tool calls are read; None: no tools given."""


def parse_completion(body: object, models: Mapping[str, pb.ModelInfo], max_n: int = DEFAULT_MAX_N) -> OpenAIRequest:
    """A /v1/completions body; ``models``: the served models by id; ``max_n``: the most samples."""
    body = _object(body)
    request = pb.GenerateRequest()
    prompt = _prompt(body.get("prompt"))
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    parsed = _common(body, request, models, COMPLETION_DEFAULT_MAX_TOKENS, max_n)
    return dataclasses.replace(parsed, logprobs=_set_logprobs(request, completion_logprobs(body)))


def parse_chat(body: object, models: Mapping[str, pb.ModelInfo], max_n: int = DEFAULT_MAX_N) -> OpenAIRequest:
    """A /v1/chat/completions body; ``models``: the served models by id; ``max_n``: the most samples."""
    body = _object(body)
    request = pb.GenerateRequest()
    request.messages.extend(_messages(body.get("messages")))
    parsed = _common(body, request, models, None, max_n)
    tools = parse_tools(body, request, parsed.constraint_field)
    constraint_field = "tool_choice" if tools is not None and tools.constrained else parsed.constraint_field
    return dataclasses.replace(parsed, logprobs=_set_logprobs(request, chat_logprobs(body)), tools=tools, constraint_field=constraint_field)


def _set_logprobs(request: pb.GenerateRequest, logprobs: int | None) -> int | None:
    if logprobs is not None:
        request.sampling.logprobs = logprobs
    return logprobs


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, f"request body: must be a JSON object, got {type(body).__name__}")
    return body


def _common(body: dict, request: pb.GenerateRequest, models: Mapping[str, pb.ModelInfo], default_max_tokens: int | None, max_n: int) -> OpenAIRequest:
    model = _model(body.get("model"), models)
    request.model = model
    _refuse_unsupported(body)
    for name in ("temperature", "top_p"):
        value = number(body, name)
        if value is not None:
            setattr(request.sampling, name, value)
    if request.sampling.HasField("temperature") and not 0 <= request.sampling.temperature <= 2:
        raise invalid("temperature", f"must be in [0, 2], got {body['temperature']}")
    if request.sampling.HasField("top_p") and not 0 < request.sampling.top_p <= 1:
        raise invalid("top_p", f"must be in (0, 1], got {body['top_p']}")
    for name, low, high in (("top_k", 0, _INT32_MAX), ("seed", -(2**63), 2**63 - 1)):
        value = integer(body, name)
        if value is not None:
            if not low <= value <= high:
                raise invalid(name, f"must be in [{low}, {high}], got {value}")
            setattr(request.sampling, name, value)
    request.stop.max_tokens = _max_tokens(body, default_max_tokens, models[model].max_model_len)
    request.stop.stop.extend(_stop(body.get("stop")))
    request.stop.stop_token_ids.extend(_int_list(body, "stop_token_ids"))
    request.stop.ignore_eos = _boolean(body, "ignore_eos", False)
    apply_sampling_fields(body, request.sampling, request.stop.max_tokens, max_n)
    constraint_field = constraint_from(body, request)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", f"must be an object, got {type(options).__name__}")
    if options and not stream:
        raise invalid("stream_options", "only allowed when stream is true")
    include_usage = _boolean(options or {}, "include_usage", False, "stream_options.include_usage")
    _resume(body.get("resume"), request)
    return OpenAIRequest(
        request, model, stream, include_usage, _boolean(body, "return_resume", False),
        num_choices=request.sampling.n if request.sampling.HasField("n") else 1, constraint_field=constraint_field,
    )


def _resume(resume: object, request: pb.GenerateRequest) -> None:
    """``resume``: the token ids a cut stream delivered and the last tag its chunks carried."""
    if resume is None:
        return
    if not isinstance(resume, dict):
        raise invalid("resume", f"must be an object with token_ids and tag, got {type(resume).__name__}")
    request.resume.token_ids.extend(_int_list(resume, "token_ids", "resume.token_ids"))
    tag = resume.get("tag")
    if not isinstance(tag, str):
        raise invalid("resume.tag", "required: the tag of the last chunk received (base64)")
    try:
        request.resume.tag = base64.b64decode(tag, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("resume.tag", "not base64") from None


def _model(model: object, models: Mapping[str, pb.ModelInfo]) -> str:
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: a model id from GET /v1/models")
    if not models:
        raise APIError(503, "no live decode worker", code="unavailable")
    if model not in models:
        raise APIError(404, f"model: {model[:64]!r} is not served here (served: {', '.join(models)})", param="model", code="model_not_found")
    return model


def _refuse_unsupported(body: dict) -> None:
    for name, unused in _UNSUPPORTED.items():
        if name in body and body[name] not in unused:
            raise invalid(name, "not supported by splitserve")


def _max_tokens(body: dict, default: int | None, max_model_len: int) -> int:
    """``max_completion_tokens`` (chat's newer name) wins over ``max_tokens``. None: as many as
    the context holds (the engine stops at ``max_model_len``)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = integer(body, name)
    if value is None:
        return default if default is not None else max(1, max_model_len)
    if not 1 <= value <= _INT32_MAX:
        raise invalid(name, f"must be in [1, {_INT32_MAX}], got {value}")
    return value


def _prompt(prompt: object) -> str | list[int]:
    """A string, a list of token ids, or a batch of exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if prompt is None:
        raise invalid("prompt", "required")
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "must not be empty")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("prompt", "must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t <= _INT32_MAX), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is out of range")
            return prompt
        if all(isinstance(p, (str, list)) for p in prompt):
            raise invalid("prompt", f"one prompt per request (n=1), got a batch of {len(prompt)}")
    raise invalid("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")


def _messages(messages: object) -> list[pb.ChatMessage]:
    if messages is None:
        raise invalid("messages", "required")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, message: object) -> pb.ChatMessage:
    """One message; an assistant turn may carry ``tool_calls``, a ``tool`` turn answers one
    (``tool_call_id``, and optionally the function's ``name``)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise invalid(where, f"must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in _CHAT_ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(_CHAT_ROLES)}, got {role!r}")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        content = "".join(_text_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    if not isinstance(content, str):
        raise invalid(f"{where}.content", f"must be a string or a list of text parts, got {type(content).__name__}")
    out = pb.ChatMessage(role=_CHAT_ROLES[role], content=content)
    if role == "assistant" and message.get("tool_calls") is not None:
        message_tool_calls(where, message["tool_calls"], out)
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{where}.tool_call_id", "required: the id of the tool call this message answers")
        out.tool_call_id = call_id
        if isinstance(message.get("name"), str):
            out.name = message["name"]
    return out


def _text_part(where: str, part: object) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise invalid(where, f"only text parts ({{'type': 'text', 'text': ...}}) are supported, got {kind!r}")
    return part["text"]


def _stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        return stop
    raise invalid("stop", "must be a non-empty string or a list of them")


def _boolean(body: Mapping, name: str, default: bool, where: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(where or name, f"must be true or false, got {value!r}")
    return value


def _int_list(body: Mapping, name: str, where: str | None = None) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _INT32_MAX for v in value):
        raise invalid(where or name, "must be a list of token ids (integers >= 0)")
    return value
