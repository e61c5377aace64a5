"""An LLMEngine on its own thread, fed and drained from asyncio.

The engine is single-threaded and its ``step()`` blocks for the whole forward pass, so it lives
on a dedicated thread, which also builds it: once a thread has run a parallel torch op, libgomp
counts its OpenMP team against the cores and, with more OpenMP threads than cores, stops
spin-waiting, so every parallel op on any *other* thread pays ~80 us to wake its team (measured:
a decode step of SmolLM2 went from 37 ms to 63 ms). Keeping all torch work on this one thread
avoids that. Callers on the event loop talk to it only through a command queue, and
the thread hands outputs back with ``call_soon_threadsafe``; no engine method is ever called
from the event loop, and the event loop never waits on the engine.

::

    event loop                        engine thread
    ----------                        -------------
    submit()  --(ADD, future)-->      add_request()  --> future result / InvalidRequestError
    abort()   --(ABORT)-------->      abort_request()
    call(fn)  --(CALL, future)->      fn(engine)     --> future result / exception
    stream queue <--outputs----       step()
    stream queue <--error------       take_failures()  (a request a step raised for, alone)

A step that raises for one request fails that request's stream only (``engine/isolation.py``);
any other exception of a step ends the loop and fails every stream with EngineLoopFailed, so
the replica is replaced and its requests move.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.cpus import pin_current_thread
from engine.errors import AdmissionQueueFull, EngineLoopFailed, InvalidRequestError, RequestFailedError
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats
from engine.request import EngineRequest, RequestOutput


@dataclass(frozen=True)
class _Add:
    request: EngineRequest
    admitted: Future
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    admit: Callable[[LLMEngine, EngineRequest], object] | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], object]
    result: Future


@dataclass(frozen=True)
class _Stop:
    pass


class EngineLoop:
    """Runs ``engine`` on a background thread; ``generate`` streams one request's outputs."""

    def __init__(
        self, build_engine: Callable[[], LLMEngine], max_waiting_requests: int, num_threads: int, nice: int = 0, cpus: frozenset[int] | None = None
    ) -> None:
        self.max_waiting_requests = max_waiting_requests
        self.num_threads = num_threads
        self.nice = nice
        """Added to the engine thread's nice value before it starts any OpenMP thread (they inherit it)."""
        self.cpus = cpus
        """CPUs the engine thread is pinned to before it starts any OpenMP thread (they inherit them); None: not pinned."""
        self._build_engine = build_engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.engine: LLMEngine | None = None

    def start(self) -> None:
        """Build the engine on the loop's thread and start stepping; raises what building raised."""
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def stop(self) -> None:
        self._commands.put(_Stop())
        self._thread.join()

    @property
    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._failure is None

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Run ``fn(engine)`` on the engine thread between two steps; its result or exception.

        ``fn`` runs even if the caller is cancelled while it waits (the cancel only stops the
        waiting): a cleanup awaited in a ``finally``, such as releasing a lease, is never skipped."""
        if self._failure is not None:
            raise EngineLoopFailed(f"engine loop failed: {self._failure!r}")
        result: Future = Future()
        self._commands.put(_Call(fn, result))
        return await asyncio.shield(asyncio.wrap_future(result))

    async def generate(self, request: EngineRequest, admit: Callable[[LLMEngine, EngineRequest], object] | None = None) -> AsyncIterator[RequestOutput | object]:
        """Outputs of ``request`` until it finishes. Leaving early (cancel, close) aborts it.

        ``admit(engine, request)`` replaces ``add_request`` (e.g. a remote-prefill admission);
        what it returns is yielded first. Raises InvalidRequestError or
        AdmissionQueueFull before the first output; RequestFailedError when a step raised for
        this request alone (the loop goes on); EngineLoopFailed when the loop died.
        """
        if self._failure is not None:
            raise EngineLoopFailed(f"engine loop failed: {self._failure!r}")
        loop = asyncio.get_running_loop()
        if request.params.constraint is not None:  # compiled here, off the engine thread: add_request finds it cached
            await loop.run_in_executor(None, self.engine.grammars.compile, request.params.constraint)
        admitted: Future = Future()
        outputs: asyncio.Queue = asyncio.Queue()
        self._commands.put(_Add(request, admitted, outputs, loop, admit))
        finished = False
        try:
            admission = await asyncio.wrap_future(admitted)  # a cancel while waiting here still aborts below
            if admit is not None:
                yield admission
            while not finished:
                output = await outputs.get()
                if isinstance(output, (EngineLoopFailed, RequestFailedError)):
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._commands.put(_Abort(request.request_id))

    def _run(self) -> None:
        if self.nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + self.nice)
        try:
            if self.cpus is not None:
                pin_current_thread(self.cpus)
            torch.set_num_threads(self.num_threads)
            self.engine = self._build_engine()
            self._stats = self.engine.stats()
        except BaseException as e:  # reported by start() in the caller's thread
            self._failure = e
            return
        finally:
            self._ready.set()
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block):
                    return
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    failures = self.engine.take_failures()
                    self._stats = self.engine.stats()  # before delivery: a caller that sees its last output sees its blocks freed
                    self.deliver(*outputs)
                    self._fail_streams(failures)
        except BaseException as e:  # the loop is dead: fail every stream instead of hanging it
            self._failure = e
            for outputs, loop in self._streams.values():
                _post(loop, outputs.put_nowait, EngineLoopFailed(f"engine loop failed: {e!r}"))
            raise

    def _drain_commands(self, block: bool) -> bool:
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Abort):
                self._streams.pop(command.request_id, None)
                if self.engine.abort_request(command.request_id):
                    self._stats = self.engine.stats()
                continue
            if isinstance(command, _Call):
                self._call(command)
                continue
            self._add(command)

    def _call(self, command: _Call) -> None:
        command.result.set_running_or_notify_cancel()  # never cancelled: ``call`` shields it
        try:
            value = command.fn(self.engine)
        except Exception as e:  # the caller's to handle; the loop goes on
            command.result.set_exception(e)
        else:
            command.result.set_result(value)
        self._stats = self.engine.stats()

    def _add(self, command: _Add) -> None:
        if not command.admitted.set_running_or_notify_cancel():
            return  # the caller stopped waiting before admission: nothing to add
        request = command.request
        stats = self._stats
        free_slots = max(0, self.engine.config.max_num_seqs - stats.num_running)
        if stats.num_waiting - free_slots >= self.max_waiting_requests:
            command.admitted.set_exception(AdmissionQueueFull(f"{stats.num_waiting} requests already waiting"))
            return
        try:
            if command.admit is None:
                admission = self.engine.add_request(
                    request.request_id,
                    request.prompt,
                    request.params,
                    messages=request.messages,
                    tenant_salt=request.tenant_salt,
                    arrival_s=request.arrival_s,
                    resume_token_ids=request.resume_token_ids,
                )
            else:
                admission = command.admit(self.engine, request)
        except InvalidRequestError as e:
            command.admitted.set_exception(e)
            return
        self._streams[request.request_id] = (command.outputs, command.loop)
        self._stats = self.engine.stats()
        command.admitted.set_result(admission)

    def _fail_streams(self, failures: list[RequestFailedError]) -> None:
        """End the stream of each request the engine failed alone with its error; the others go on."""
        for failure in failures:
            stream = self._streams.pop(failure.request_id, None)
            if stream is not None:
                outputs, loop = stream
                _post(loop, outputs.put_nowait, failure)

    def deliver(self, *outputs: RequestOutput) -> None:
        """Hand each output to its request's stream: a step's outputs, or one produced by a
        ``call`` (a remote-prefill join). Engine thread only. Outputs bound for one event loop
        cross threads in one callback: each crossing writes the loop's wake-up pipe, which cost
        the engine thread ~0.1 ms per output when done one by one (py-spy, 8 streams)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            queue_, loop = self._streams[output.request_id]
            if output.finished:
                del self._streams[output.request_id]
            by_loop.setdefault(loop, []).append((queue_, output))
        for loop, items in by_loop.items():
            if not _post(loop, _put_all, items):
                # The callers' event loop is gone without an abort: nobody will read these streams.
                for _, output in items:
                    if not output.finished:
                        del self._streams[output.request_id]
                        self.engine.abort_request(output.request_id)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, output in items:
        queue_.put_nowait(output)


def _post(loop: asyncio.AbstractEventLoop, callback, item) -> bool:
    """Hand ``item`` to ``loop``; False if that loop has been closed."""
    try:
        loop.call_soon_threadsafe(callback, item)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True
