"""Each endpoint's choices, whole and streamed: one ``*Choice`` per sample of a request.

A streamed chat answer with tools is sent as follows:

    tool_choice none, or no tools   content deltas as they come
    auto, template with a parser    content deltas until a call may begin (a partial
                                    ``<tool_call>`` is held back), then the rest is held;
                                    at the end one delta with every call, whole
                                    (id, name and all of ``arguments``), or the held text
    required, a named function      everything held; one delta with every call at the end

Log-probabilities travel with the delta of their tokens (held ones with the last delta).
"""

from __future__ import annotations

from proto import splitserve_pb2 as pb
from router.frontend.apis.openai_shapes import FINISH_REASONS, Sample, chat_logprobs, completion_logprobs
from router.frontend.apis.token_texts import TokenStrings
from router.frontend.apis.openai_tools import ToolPlan, finish_reason, read_calls, tool_call_bodies
from router.frontend.apis.tool_parsers import ParsedOutput, ToolCallParser


class CompletionChoice:
    """/v1/completions: ``text`` and the legacy ``logprobs`` object."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, index: int, strings: TokenStrings, logprobs: bool) -> None:
        self.index = index
        self._strings = strings
        self._logprobs = logprobs
        self._text_offset = 0

    def whole(self, sample: Sample) -> dict:
        logprobs = completion_logprobs(sample.logprobs, self._strings, 0) if self._logprobs else None
        return {"index": self.index, "text": sample.text, "logprobs": logprobs, "finish_reason": sample.finish_reason}

    def opening(self) -> dict | None:
        return None

    def empty(self) -> dict:
        return {"index": self.index, "text": "", "logprobs": None, "finish_reason": None}

    def feed(self, response: pb.GenerateResponse) -> list[dict]:
        logprobs = None
        if self._logprobs and response.logprobs:
            logprobs = completion_logprobs(response.logprobs, self._strings, self._text_offset)
            self._text_offset += sum(len(t) for t in logprobs["tokens"])
        if not response.text and logprobs is None:
            return []
        return [{**self.empty(), "text": response.text, "logprobs": logprobs}]

    def finish(self, response: pb.GenerateResponse) -> list[dict]:
        return [{**self.empty(), "finish_reason": FINISH_REASONS.get(response.finish_reason)}]


class ChatChoice:
    """/v1/chat/completions: the assistant message, its tool calls and ``logprobs.content``."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, index: int, strings: TokenStrings, logprobs: bool, plan: ToolPlan | None, parser: ToolCallParser | None) -> None:
        self.index = index
        self._strings = strings
        self._logprobs = logprobs
        self._plan = plan
        self._parser = parser if plan is not None and plan.choice == "auto" else None
        self._holds_all = plan is not None and plan.constrained
        self._text = ""
        self._num_sent = 0
        self._held_logprobs: list[dict] = []

    def whole(self, sample: Sample) -> dict:
        parsed = read_calls(self._plan, self._parser, sample.text)
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = tool_call_bodies(parsed.calls)
        logprobs = {"content": chat_logprobs(sample.logprobs, self._strings)} if self._logprobs else None
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(self._plan, parsed, sample.finish_reason)}

    def opening(self) -> dict | None:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def empty(self) -> dict:
        return {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": None}

    def _delta(self, delta: dict, logprobs: list[dict] | None) -> dict:
        return {**self.empty(), "delta": delta, "logprobs": {"content": logprobs} if logprobs is not None else None}

    def feed(self, response: pb.GenerateResponse) -> list[dict]:
        self._text += response.text
        logprobs = chat_logprobs(response.logprobs, self._strings) if self._logprobs and response.logprobs else None
        if self._holds_all:
            self._held_logprobs += logprobs or []
            return []
        limit = len(self._text)
        if self._parser is not None:
            start = self._parser.call_start(self._text)
            limit = limit if start is None else max(start, self._num_sent)
        text = self._text[self._num_sent : limit]
        self._num_sent = limit
        if not text and logprobs is None:
            return []
        return [self._delta({"content": text} if text else {}, logprobs)]

    def finish(self, response: pb.GenerateResponse) -> list[dict]:
        reason = FINISH_REASONS.get(response.finish_reason)
        parsed = read_calls(self._plan, self._parser, self._text) if self._holds_all or self._parser else ParsedOutput(self._text)
        held = self._held_logprobs if self._logprobs and self._held_logprobs else None
        out = []
        if parsed.calls:
            out.append(self._delta({"tool_calls": tool_call_bodies(parsed.calls, with_index=True)}, held))
        elif self._num_sent < len(self._text) or held is not None:
            rest = self._text[self._num_sent :]
            out.append(self._delta({"content": rest} if rest else {}, held))
        self._num_sent = len(self._text)
        out.append({**self.empty(), "finish_reason": finish_reason(self._plan, parsed, reason)})
        return out
