"""Continuous batching: one thread drives the decode engine; async callers join and leave between steps.

The engine is not thread-safe, so everything that touches it (adding and cancelling requests,
swapping drafts) is a command the loop thread runs between two `step()` calls. Each request's
outputs go to its own asyncio queue on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from engine.requests import Request, RequestError, RequestOutput
from engine.scheduler import DecodeEngine

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests than running slots plus queue places: the caller answers 503."""


@dataclass(frozen=True)
class StreamError:
    """The last item of a request's queue when it cannot finish."""

    status: int  # HTTP status to answer with
    message: str


class EngineLoop:
    def __init__(self, engine: DecodeEngine, max_queue: int) -> None:
        self.engine = engine
        self.capacity = engine.max_batch_size + max_queue
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ----- called from the event loop ------------------------------------------------------
    def submit(self, request: Request) -> asyncio.Queue:
        """Queue a request; its outputs (RequestOutput, then a final one or a StreamError) arrive on the queue."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if len(self._streams) >= self.capacity:
                raise QueueFull(f"the server is at capacity ({self.capacity} requests in flight on this replica); "
                                "retry shortly")
            outputs: asyncio.Queue = asyncio.Queue()
            self._streams[request.request_id] = (loop, outputs)
        self._send(("add", request))
        return outputs

    def cancel(self, request_id: str) -> None:
        """Drop a request (client gone); its cache row is free at the next step."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._send(("cancel", request_id))

    def call(self, fn: Callable[[DecodeEngine], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the loop thread between steps (e.g. a draft swap)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", (fn, future)))
        return future

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # ----- the loop thread -----------------------------------------------------------------
    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item, last: bool) -> None:
        with self._lock:
            target = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if target is not None:
            loop, outputs = target
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

    def _drain(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(arg)
                except (RequestError, ValueError) as exc:
                    self._deliver(arg.request_id, StreamError(400, str(exc)), last=True)
            elif kind == "cancel":
                self.engine.cancel(arg)
            elif kind == "call":
                fn, future = arg
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:  # handed back to the caller
                    future.set_exception(exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain()
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs: list[RequestOutput] = self.engine.step()
            except Exception as exc:  # a failed step fails the requests in it, not the server
                log.exception("engine step failed")
                self._fail_all(f"generation failed: {type(exc).__name__}: {exc}")
                continue
            self.steps += 1
            for out in outputs:
                self._deliver(out.request_id, out, last=out.finished)

    def _fail_all(self, message: str) -> None:
        for request_id in self.engine.request_ids():
            self.engine.cancel(request_id)
            self._deliver(request_id, StreamError(500, message), last=True)
