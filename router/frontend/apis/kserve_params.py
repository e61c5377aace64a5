"""KServe request parameters and the ``sampling_parameters`` input -> SamplingParams and
StopConditions: pure functions, no I/O.

vLLM's SamplingParams names, in the request's ``parameters`` (Triton's) or the
``sampling_parameters`` JSON input (the vLLM backend's; it wins over a parameter of the same
name). A refusal names where the value came from: ``parameters.top_k`` or
``sampling_parameters.top_k``::

    temperature top_p top_k seed                  sampling
    presence_penalty frequency_penalty repetition_penalty min_tokens
    logprobs        0..20 top alternatives: the response gains a ``logprobs`` output (tensors.py)
    n               1 only (one text_output per request; the OpenAI API's n gives more)
    max_tokens ignore_eos stop stop_token_ids     stopping
    json_schema (JSON text) | json_object (bool) | regex | choice (a JSON array of strings)
    | grammar (+ grammar_syntax "lark" | "ebnf")  at most one constraint

Numbers and booleans may come as strings (Triton's parameters and the vLLM backend's JSON both
allow it). In ``sampling_parameters`` an unknown name is refused; in ``parameters`` it is left
alone (they carry Triton's own flags too).
"""

from __future__ import annotations

from collections.abc import Mapping

from proto import splitserve_pb2 as pb
from router.frontend.apis.constraints import fill_constraint, parse_json
from router.frontend.apis.errors import invalid

_SAMPLING_KEYS = {
    # name: (where it goes, type)
    "temperature": ("sampling", float),
    "top_p": ("sampling", float),
    "top_k": ("sampling", int),
    "seed": ("sampling", int),
    "presence_penalty": ("sampling", float),
    "frequency_penalty": ("sampling", float),
    "repetition_penalty": ("sampling", float),
    "min_tokens": ("sampling", int),
    "logprobs": ("sampling", int),
    "n": ("sampling", int),
    "max_tokens": ("stop", int),
    "ignore_eos": ("stop", bool),
    "stop": ("stop", list),
    "stop_token_ids": ("stop", list),
}
CONSTRAINT_KEYS = ("json_schema", "json_object", "regex", "choice", "grammar")
KNOWN_KEYS = (*_SAMPLING_KEYS, *CONSTRAINT_KEYS, "grammar_syntax")


def apply_parameters(request: pb.GenerateRequest, values: Mapping[str, tuple[object, str]]) -> None:
    """Set each ``name: (value, where)`` on ``request``; ``where`` names it in a refusal."""
    for key, (value, where) in values.items():
        if key not in KNOWN_KEYS:
            raise invalid(where, f"unknown parameter (known: {', '.join(KNOWN_KEYS)})")
        if value is None or key in CONSTRAINT_KEYS or key == "grammar_syntax":
            continue
        target, kind = _SAMPLING_KEYS[key]
        converted = convert(where, value, kind)
        if key == "n" and converted != 1:
            raise invalid(where, f"only 1 sample per KServe request (the OpenAI API's n gives more), got {value!r}")
        if key == "n":
            continue
        message = request.sampling if target == "sampling" else request.stop
        if kind is list:
            getattr(message, key).extend(converted)
            continue
        try:
            setattr(message, key, converted)
        except ValueError as e:
            raise invalid(where, f"{value!r} is out of range") from e
    _constraint(request.sampling.constraint, values)


def _constraint(constraint: pb.Constraint, values: Mapping[str, tuple[object, str]]) -> None:
    given = [k for k in CONSTRAINT_KEYS if values.get(k, (None,))[0] is not None]
    if len(given) > 1:
        raise invalid(values[given[1]][1], f"give at most one of {', '.join(CONSTRAINT_KEYS)} (got {', '.join(given)})")
    if "grammar_syntax" in values and "grammar" not in given:
        raise invalid(values["grammar_syntax"][1], "only with grammar")
    if not given:
        return
    kind = given[0]
    value, where = values[kind]
    if kind == "json_object":
        if convert(where, value, bool):
            constraint.json_object = True
        return
    if kind == "choice" and isinstance(value, str):
        value = parse_json(where, value)
    fill_constraint(constraint, kind, value, where, values.get("grammar_syntax"))


def constraint_field(values: Mapping[str, tuple[object, str]]) -> str | None:
    """Where the constraint came from (to name the engine's refusal of it), or None."""
    return next((values[k][1] for k in CONSTRAINT_KEYS if values.get(k, (None,))[0] is not None), None)


def convert(where: str, value: object, kind: type):
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind is list:
        items = [value] if isinstance(value, (str, int)) and not isinstance(value, bool) else value
        if where.endswith("stop") and isinstance(items, list) and all(isinstance(s, str) and s for s in items):
            return items
        if where.endswith("stop_token_ids") and isinstance(items, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
            return items
    elif not isinstance(value, bool):
        try:
            converted = kind(value)
            if kind is int and isinstance(value, float) and value != converted:
                raise ValueError
            return converted
        except (TypeError, ValueError):
            pass
    expected = {bool: "true or false", list: "a list", float: "a number", int: "an integer"}[kind]
    raise invalid(where, f"must be {expected}, got {value!r}")
