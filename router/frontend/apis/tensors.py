"""KServe v2 tensors and the LLM convention of Triton's vLLM backend: pure functions, no I/O.

A generation is one inference request with these inputs (each one element; shape ``[1]``, or
``[1, 1]`` from a client that batches)::

    text_input               BYTES  the prompt (UTF-8)                      required
    stream                   BOOL   decoupled: one response per new piece   default false
    sampling_parameters      BYTES  JSON object of vLLM SamplingParams names default {}
    exclude_input_in_output  BOOL   leave the prompt out of text_output     default false

and the outputs ``text_output`` (BYTES) and, when the request sets the ``logprobs`` parameter
(kserve_params.py), ``logprobs`` (BYTES): one JSON array per response, an entry for each of
that response's tokens::

    [{"token_id": 9906, "token": "Hello", "logprob": -0.31,
      "top": [{"token_id": 9906, "token": "Hello", "logprob": -0.31}, ...]}, ...]

Streamed responses carry only the new text (and its tokens' log-probabilities), so
``exclude_input_in_output`` matters to a non-streamed call only, as in the vLLM backend.
BYTES elements travel as a 4-byte little-endian length and the bytes, back to back.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import APIError, invalid
from router.frontend.apis.kserve_params import KNOWN_KEYS, apply_parameters, constraint_field

TEXT_INPUT, STREAM, SAMPLING_PARAMETERS, EXCLUDE_INPUT = "text_input", "stream", "sampling_parameters", "exclude_input_in_output"
TEXT_OUTPUT, LOGPROBS_OUTPUT = "text_output", "logprobs"
INPUT_DATATYPES = {TEXT_INPUT: "BYTES", STREAM: "BOOL", SAMPLING_PARAMETERS: "BYTES", EXCLUDE_INPUT: "BOOL"}
"""Every input the model takes, and its datatype (as ModelMetadata lists them)."""

@dataclass(frozen=True)
class Tensor:
    """One decoded input: its declared datatype and shape, and its elements in row-major order."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: list


@dataclass(frozen=True)
class LLMRequest:
    """A parsed inference request of the LLM convention."""

    generate: pb.GenerateRequest
    stream: bool
    exclude_input_in_output: bool
    prompt: str
    logprobs: bool = False
    """The responses carry a ``logprobs`` output."""
    constraint_field: str | None = None
    """The parameter that constrains the answer, to name in the engine's refusal of it."""


def deserialize_bytes(name: str, raw: bytes) -> list[bytes]:
    """BYTES elements from their length-prefixed wire form."""
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise invalid(name, f"BYTES data ends inside a length prefix at byte {offset}")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise invalid(name, f"BYTES element of {length} bytes overruns the {len(raw)}-byte tensor")
        items.append(raw[offset : offset + length])
        offset += length
    return items


def serialize_bytes(items: Sequence[bytes]) -> bytes:
    """The length-prefixed wire form of BYTES elements."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def deserialize_bool(name: str, raw: bytes) -> list[bool]:
    return [b != 0 for b in raw]


def num_elements(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


def llm_request(model: str, inputs: Mapping[str, Tensor], parameters: Mapping[str, object] = {}) -> LLMRequest:
    """The GenerateRequest of an inference request; ``parameters``: the request's own parameters
    (a sampling key there is taken as one in ``sampling_parameters``, which wins)."""
    for name, tensor in inputs.items():
        _check_tensor(name, tensor)
    if TEXT_INPUT not in inputs:
        raise invalid(TEXT_INPUT, "required input is missing")
    prompt = _text(inputs[TEXT_INPUT])
    if not prompt:
        raise invalid(TEXT_INPUT, "must not be empty")
    values = {k: (v, f"parameters.{k}") for k, v in parameters.items() if k in KNOWN_KEYS}
    if SAMPLING_PARAMETERS in inputs:
        values.update({k: (v, f"{SAMPLING_PARAMETERS}.{k}") for k, v in _sampling_json(_text(inputs[SAMPLING_PARAMETERS])).items()})
    request = pb.GenerateRequest(model=model, prompt=prompt)
    apply_parameters(request, values)
    stream = bool(inputs[STREAM].values[0]) if STREAM in inputs else False
    exclude = bool(inputs[EXCLUDE_INPUT].values[0]) if EXCLUDE_INPUT in inputs else False
    return LLMRequest(request, stream, exclude, prompt, request.sampling.HasField("logprobs"), constraint_field(values))


def logprobs_json(entries: Sequence[pb.TokenLogprobs], strings: Callable[[int], tuple[str, list[int]]]) -> str:
    """The ``logprobs`` output element of one response (see the module docstring)."""

    def item(token_id: int, logprob: float) -> dict:
        return {"token_id": token_id, "token": strings(token_id)[0], "logprob": logprob}

    return json.dumps([{**item(e.token_id, e.logprob), "top": [item(t.token_id, t.logprob) for t in e.top]} for e in entries], ensure_ascii=False)


def named_constraint(message: str, field: str | None) -> str:
    """The engine names a bad schema, regex or grammar ``constraint.*``; the client sent it as ``field``."""
    return f"{field}: {message}" if field and message.startswith("constraint") else message


def _check_tensor(name: str, tensor: Tensor) -> None:
    if name not in INPUT_DATATYPES:
        raise invalid(name, f"unknown input (the model takes {', '.join(INPUT_DATATYPES)})")
    if tensor.datatype != INPUT_DATATYPES[name]:
        raise invalid(name, f"datatype must be {INPUT_DATATYPES[name]}, got {tensor.datatype}")
    if any(d < 0 for d in tensor.shape) or num_elements(tensor.shape) != 1:
        raise invalid(name, f"shape {list(tensor.shape)} must hold exactly one element (one prompt per request), e.g. [1]")
    if len(tensor.values) != 1:
        raise invalid(name, f"shape {list(tensor.shape)} holds one element but the data has {len(tensor.values)}")


def _text(tensor: Tensor) -> str:
    value = tensor.values[0]
    if isinstance(value, str):
        return value
    if not isinstance(value, bytes):
        raise invalid(tensor.name, f"BYTES data must be a string, got {type(value).__name__}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(tensor.name, f"not valid UTF-8 ({e})") from e


def _sampling_json(text: str) -> dict:
    try:
        sampling = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise invalid(SAMPLING_PARAMETERS, f"not valid JSON ({e})") from e
    if not isinstance(sampling, dict):
        raise invalid(SAMPLING_PARAMETERS, f"must be a JSON object, got {type(sampling).__name__}")
    return sampling


def unknown_model(model: str, served: Sequence[str]) -> APIError:
    return APIError(404, f"model: {model[:64]!r} is not served here (served: {', '.join(served) or 'none'})", param="model", code="model_not_found")


def model_metadata(model: str) -> dict:
    """KServe v2 model metadata, as the HTTP API answers it (the gRPC one has the same fields)."""
    return {
        "name": model,
        "versions": ["1"],
        "platform": "splitserve",
        "inputs": [{"name": name, "datatype": datatype, "shape": [1]} for name, datatype in INPUT_DATATYPES.items()],
        "outputs": [{"name": TEXT_OUTPUT, "datatype": "BYTES", "shape": [-1]}, {"name": LOGPROBS_OUTPUT, "datatype": "BYTES", "shape": [-1]}],
    }
