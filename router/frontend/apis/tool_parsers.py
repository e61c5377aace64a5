"""Tool calls in a model's free text, by the format its chat template teaches: a registry of
parsers keyed by format name, and the choice of one from the template's source.

    hermes       Hermes / Qwen:  <tool_call>{"name": ..., "arguments": {...}}</tool_call> (one or more)
    llama3_json  Llama 3.x:      {"name": ..., "parameters": {...}} (after <|python_tag|>, or alone;
                                 several separated by ';'), and nothing else in the answer

A template that mentions neither gets no parser: the answer is plain content. Output that looks
like a call but does not parse (bad JSON, no name) is plain content too, never an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar, Protocol


@dataclass(frozen=True)
class ParsedCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments_json: str


@dataclass(frozen=True)
class ParsedOutput:
    """An answer split into its content (None: nothing but calls) and its tool calls."""

    content: str | None
    calls: tuple[ParsedCall, ...] = ()


class ToolCallParser(Protocol):
    """Reads one format of tool calls."""

    name: ClassVar[str]

    @staticmethod
    def teaches(template: str) -> bool:
        """Whether a chat template's source asks the model for this format."""

    def parse(self, text: str) -> ParsedOutput:
        """The whole answer: its calls, or all of it as content when it holds none that parse."""

    def call_start(self, text: str) -> int | None:
        """Where a call begins (or may begin: a partial marker at the end) in a streamed answer
        so far; the text before it can be sent as content. None: no call started."""


_PARSERS: dict[str, type] = {}


def register(cls: type) -> type:
    _PARSERS[cls.name] = cls
    return cls


def parser_named(name: str) -> ToolCallParser:
    return _PARSERS[name]()


def parser_for_template(template: str | None) -> ToolCallParser | None:
    """The parser of the first registered format the template teaches; None for none."""
    if not template:
        return None
    for cls in _PARSERS.values():
        if cls.teaches(template):
            return cls()
    return None


def _call(obj: object, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


@register
class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks; the text before the first one is the content."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    @staticmethod
    def teaches(template: str) -> bool:
        return HermesParser.START in template

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return ParsedOutput(text)
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:start].strip() or None, tuple(calls))

    def call_start(self, text: str) -> int | None:
        return _marker_start(text, self.START)


@register
class Llama3JsonParser:
    """A JSON object (or several, ';'-separated) making up the whole answer."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    _DECODER = json.JSONDecoder()

    @staticmethod
    def teaches(template: str) -> bool:
        return Llama3JsonParser.PYTHON_TAG in template or '"parameters": dictionary of argument name' in template

    def parse(self, text: str) -> ParsedOutput:
        rest = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not rest.startswith("{"):
            return ParsedOutput(text)
        calls = []
        while rest:
            try:
                obj, end = self._DECODER.raw_decode(rest)
            except json.JSONDecodeError:
                return ParsedOutput(text)
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
            rest = rest[end:].lstrip().removeprefix(";").lstrip()
        return ParsedOutput(None, tuple(calls))

    def call_start(self, text: str) -> int | None:
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(self.PYTHON_TAG) or self.PYTHON_TAG.startswith(head):
            return 0
        return None


def _marker_start(text: str, marker: str) -> int | None:
    """Where ``marker`` starts in ``text``, or where a suffix of ``text`` that begins it starts."""
    found = text.find(marker)
    if found >= 0:
        return found
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return None
