"""OpenAI ``tools`` and ``tool_choice``: what the request becomes, and the answer's tool calls.

``tools`` go to the chat template as its ``tools`` (``GenerateRequest.tools_json``) whatever
``tool_choice`` says, as vLLM does; ``tool_choice`` then decides how the answer is read:

    "none"                 the answer is content; nothing is parsed
    "auto" (with tools)    the answer is parsed in the format the chat template teaches
                           (tool_parsers.py); a template that teaches none: content
    "required"             the answer is constrained to a JSON array of one or more
                           {"name": <a tool's name>, "arguments": <its parameters schema>}
                           (exactly one with ``parallel_tool_calls: false``);
                           finish_reason "tool_calls"
    {"type": "function", "function": {"name": N}}
                           the answer is constrained to N's parameters schema: one call of N;
                           finish_reason "stop", as OpenAI answers a forced function

Each call gets an id ``call_<24 hex>``; ``function.arguments`` is JSON text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from proto import splitserve_pb2 as pb
from router.frontend.apis.errors import invalid
from router.frontend.apis.tool_parsers import ParsedCall, ParsedOutput, ToolCallParser

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How an answer's tool calls are read (see the module docstring)."""

    choice: str
    """"none", "auto", "required" or "function"."""
    function: str | None = None
    """The function a ``"function"`` choice names."""

    @property
    def constrained(self) -> bool:
        """Whether the answer is constrained to calls (and so streamed as one delta at the end)."""
        return self.choice in ("required", "function")


def parse_tools(body: Mapping, request: pb.GenerateRequest, constraint_field: str | None) -> ToolPlan | None:
    """``tools`` and ``tool_choice`` onto ``request``; ``constraint_field``: the field that
    already constrains the answer (response_format, structured_outputs), if any."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise invalid(legacy, "not supported; use tools and tool_choice")
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "only allowed when tools are given")
        return None
    if not isinstance(tools, list):
        raise invalid("tools", f"must be a list of tool definitions, got {type(tools).__name__}")
    schemas = {}
    normalized = []
    for i, tool in enumerate(tools):
        name, definition = _tool(i, tool)
        if name in schemas:
            raise invalid(f"tools[{i}].function.name", f"{name!r} is given twice")
        schemas[name] = definition.get("parameters") or _EMPTY_PARAMETERS
        normalized.append({"type": "function", "function": definition})
    request.tools_json = json.dumps(normalized, ensure_ascii=False)
    plan = _tool_choice(choice, schemas)
    if plan.constrained:
        if constraint_field is not None:
            raise invalid("tool_choice", f"a required or named tool choice cannot be combined with {constraint_field}")
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise invalid("parallel_tool_calls", f"must be true or false, got {parallel!r}")
        schema = schemas[plan.function] if plan.function else required_schema(schemas, max_calls=None if parallel is not False else 1)
        request.sampling.constraint.json_schema = json.dumps(schema, ensure_ascii=False)
    return plan


def _tool(i: int, tool: object) -> tuple[str, dict]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(f"{where}.type", "must be 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function", "must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise invalid(f"{where}.function.name", f"must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    definition = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid(f"{where}.function.description", "must be a string")
        definition["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters", f"must be a JSON Schema object, got {type(parameters).__name__}")
        definition["parameters"] = parameters
    return name, definition


def _tool_choice(choice: object, schemas: Mapping[str, dict]) -> ToolPlan:
    if choice is None:
        return ToolPlan("auto")
    if choice in ("none", "auto", "required"):
        return ToolPlan(choice)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in schemas:
            raise invalid("tool_choice", f"names no tool given: {name!r} (tools: {', '.join(schemas)})")
        return ToolPlan("function", name)
    raise invalid("tool_choice", f"must be none, auto, required or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")


def required_schema(schemas: Mapping[str, dict], max_calls: int | None = None) -> dict:
    """One or more calls (up to ``max_calls``), each of a given tool with arguments of its schema."""
    calls = [
        {"type": "object", "properties": {"name": {"const": name}, "arguments": schema}, "required": ["name", "arguments"], "additionalProperties": False}
        for name, schema in schemas.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return schema if max_calls is None else {**schema, "maxItems": max_calls}


def message_tool_calls(where: str, calls: object, message: pb.ChatMessage) -> None:
    """An assistant message's ``tool_calls`` onto ``message``."""
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls", "must be a list")
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(at, "must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise invalid(f"{at}.function.arguments", "must be a string of JSON")
        try:
            json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise invalid(f"{at}.function.arguments", f"not valid JSON ({e})") from e
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise invalid(f"{at}.id", "must be a string")
        message.tool_calls.add(id=call_id, name=function["name"], arguments_json=arguments)


def read_calls(plan: ToolPlan | None, parser: ToolCallParser | None, text: str) -> ParsedOutput:
    """An answer's content and calls as ``plan`` reads them."""
    if plan is None or plan.choice == "none":
        return ParsedOutput(text)
    if plan.choice == "auto":
        return parser.parse(text) if parser is not None else ParsedOutput(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return ParsedOutput(text)  # cut short (finish_reason length): the text as it is
    if plan.choice == "function":
        if not isinstance(value, dict):
            return ParsedOutput(text)
        return ParsedOutput(None, (ParsedCall(plan.function, json.dumps(value, ensure_ascii=False)),))
    if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
        return ParsedOutput(text)
    return ParsedOutput(None, tuple(ParsedCall(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in value))


def finish_reason(plan: ToolPlan | None, parsed: ParsedOutput, engine_reason: str | None) -> str | None:
    """"tool_calls" when the model chose to call (auto, required), else the engine's reason."""
    if parsed.calls and plan is not None and plan.choice in ("auto", "required"):
        return "tool_calls"
    return engine_reason


def tool_call_bodies(calls: tuple[ParsedCall, ...], with_index: bool = False) -> list[dict]:
    """OpenAI's ``tool_calls`` entries (a streamed delta's carry their ``index``)."""
    bodies = []
    for k, call in enumerate(calls):
        body = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
        bodies.append({"index": k, **body} if with_index else body)
    return bodies
