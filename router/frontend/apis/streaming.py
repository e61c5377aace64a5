"""Server-sent events, and calls that end when their HTTP client goes away.

A generation runs as long as someone reads it. When the client of an HTTP call disconnects,
uvicorn delivers ``http.disconnect`` on the ASGI ``receive`` channel; the helpers here watch for
it and cancel the task that drives the generation, so ``GenerationService.generate`` sees
CancelledError, cancels the request on its decode worker and the worker frees its blocks, at
once rather than at the next token or never (a client that went away mid-prefill sends nothing
more to fail on).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from router.errors import CallRejected
from router.frontend.apis.errors import from_rejected

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
"""OpenAI's end-of-stream marker."""


def sse_event(payload: dict) -> bytes:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None when the client disconnects first (``work`` is then cancelled).
    Call it after the request body has been read: ``receive`` then yields only the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel(task, watcher)
        raise
    if not task.done():
        await _cancel(task, watcher)
        return None
    watcher.cancel()
    return task.result()


async def answered_unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """``until_disconnected``, with a call the cluster refused (admission, routing, bad input)
    raised as its protocol's HTTP error: what every handler awaits before it answers."""
    try:
        return await until_disconnected(receive, work)
    except CallRejected as rejected:
        raise from_rejected(rejected) from rejected


async def _cancel(*tasks: asyncio.Future) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response from an async iterator of ready-framed events.

    The iterator is driven by its own task; a disconnect cancels that task, which raises
    CancelledError inside the iterator wherever it waits, and ``on_close`` (if given) then runs.
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, status_code=200, headers={"Cache-Control": "no-cache"}, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            try:
                async for event in self._events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass  # the client went away while we wrote; the watcher sees the disconnect too
            finally:
                aclose: Callable[[], Awaitable[None]] | None = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()

        await until_disconnected(receive, pump())
