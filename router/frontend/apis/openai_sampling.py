"""OpenAI sampling and structured-output fields -> ``SamplingParams``: pure functions, no I/O.

Spelled as OpenAI spells them: ``n``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias`` (token id as a string -> bias), chat's ``logprobs`` (bool) + ``top_logprobs``
(0..20), completions' ``logprobs`` (int; OpenAI caps it at 5, splitserve at 20), and
``response_format`` (``text``, ``json_object``, ``json_schema``: ``strict`` true or false, the
schema constrains the answer either way). vLLM's extensions: ``repetition_penalty``,
``min_tokens``, and ``structured_outputs`` (vLLM's current spelling; the older ``guided_*``
fields are refused by name, pointing here)::

    "structured_outputs": {"json": {...schema...} | "json_object": true | "regex": "..."
                           | "choice": ["a", "b"] | "grammar": "...", "grammar_syntax": "lark"|"ebnf"}

Exactly one kind; ``response_format`` (other than text) and ``structured_outputs`` exclude each other.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from proto import splitserve_pb2 as pb
from router.frontend.apis.constraints import fill_constraint
from router.frontend.apis.errors import invalid

MAX_LOGPROBS = 20
"""The most top alternatives a token may carry (OpenAI's cap for chat; the engine's)."""
DEFAULT_MAX_N = 16
"""``RouterConfig.max_n`` where the config has none."""

_INT32_MAX = 2**31 - 1
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")


def apply_sampling_fields(body: Mapping, sampling: pb.SamplingParams, max_tokens: int, max_n: int) -> None:
    """Penalties, logit bias, min_tokens and n from ``body`` onto ``sampling``."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = number(body, name)
        if value is not None:
            if not -2 <= value <= 2:
                raise invalid(name, f"must be in [-2, 2], got {body[name]}")
            setattr(sampling, name, value)
    repetition = number(body, "repetition_penalty")
    if repetition is not None:
        if not 0 < repetition <= 1e6:
            raise invalid("repetition_penalty", f"must be > 0 (1 is off), got {body['repetition_penalty']}")
        sampling.repetition_penalty = repetition
    for token_id, bias in _logit_bias(body.get("logit_bias")).items():
        sampling.logit_bias[token_id] = bias
    min_tokens = integer(body, "min_tokens")
    if min_tokens is not None:
        if not 0 <= min_tokens <= max_tokens:
            raise invalid("min_tokens", f"must be in [0, max_tokens={max_tokens}], got {min_tokens}")
        sampling.min_tokens = min_tokens
    n = integer(body, "n")
    if n is not None:
        if not 1 <= n <= max_n:
            raise invalid("n", f"must be in [1, {max_n}], got {n}")
        if n > 1:
            sampling.n = n


def _logit_bias(bias: object) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise invalid("logit_bias", f"must be an object of token id -> bias, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        if not isinstance(key, str) or not key.strip().isdigit() or int(key) > _INT32_MAX:
            raise invalid("logit_bias", f"keys must be token ids (integers >= 0, as strings), got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise invalid("logit_bias", f"bias of token {key} must be a number in [-100, 100], got {value!r}")
        out[int(key)] = float(value)
    return out


def chat_logprobs(body: Mapping) -> int | None:
    """Top alternatives per token for chat (None: no log-probabilities): ``logprobs`` true, and
    ``top_logprobs`` (0..20) only with it, as OpenAI rules."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid("logprobs", f"must be true or false, got {wanted!r}")
    top = integer(body, "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise invalid("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
    if top is not None and not wanted:
        raise invalid("top_logprobs", "only allowed when logprobs is true")
    return (top or 0) if wanted else None


def completion_logprobs(body: Mapping) -> int | None:
    """Top alternatives per token for completions: ``logprobs`` an integer (0..20)."""
    value = integer(body, "logprobs")
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def constraint_from(body: Mapping, request: pb.GenerateRequest) -> str | None:
    """Set ``request.sampling.constraint`` from ``response_format`` or ``structured_outputs``;
    returns the field the client set it with (for naming the engine's refusals), or None."""
    for name in _GUIDED:
        if body.get(name) is not None:
            raise invalid(name, "not supported; use structured_outputs ({'json' | 'json_object' | 'regex' | 'choice' | 'grammar': ...})")
    constraint = request.sampling.constraint
    field = _response_format(body.get("response_format"), constraint)
    structured = body.get("structured_outputs")
    if structured is not None:
        if field is not None:
            raise invalid("structured_outputs", "give either response_format or structured_outputs, not both")
        field = _structured_outputs(structured, constraint)
    return field


def _response_format(value: object, constraint: pb.Constraint) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("response_format", f"must be an object with a type, got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        constraint.json_object = True
        return "response_format"
    if kind != "json_schema":
        raise invalid("response_format.type", f"must be one of text, json_object, json_schema, got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema", f"must be an object with name and schema, got {type(spec).__name__}")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise invalid("response_format.json_schema.name", f"must be 1-64 letters, digits, '_' or '-', got {name!r}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid("response_format.json_schema.strict", f"must be true or false, got {spec['strict']!r}")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema", f"must be a JSON Schema object, got {type(schema).__name__}")
    constraint.json_schema = json.dumps(schema, ensure_ascii=False)
    return "response_format"


def _structured_outputs(value: object, constraint: pb.Constraint) -> str:
    if not isinstance(value, dict):
        raise invalid("structured_outputs", f"must be an object, got {type(value).__name__}")
    kinds = [k for k in _STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid("structured_outputs", f"give exactly one of {', '.join(_STRUCTURED_KINDS)} (got {', '.join(kinds) or 'none'})")
    kind = kinds[0]
    field = f"structured_outputs.{kind}"
    spec = value[kind]
    if kind == "json_object":
        if spec is not True:
            raise invalid(field, f"must be true, got {spec!r}")
        constraint.json_object = True
    else:
        syntax = (value.get("grammar_syntax", "lark"), "structured_outputs.grammar_syntax")
        fill_constraint(constraint, "json_schema" if kind == "json" else kind, spec, field, syntax)
    return field


def number(body: Mapping, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"must be a number, got {value!r}")
    return float(value)


def integer(body: Mapping, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {value!r}")
    return value
