"""An asyncio front for the engine: per-request output streams over a background step loop.

One thread owns the ``LLMEngine`` and runs ``step()`` while there is work, so the event loop never
waits for a model step. The event loop only tokenizes and validates (``prepare_prompt`` reads
immutable state) and posts adds and aborts to an inbox that the engine thread applies between
steps: an abort frees its KV blocks before the next step runs. If a step raises, every stream
gets the error, ``error`` is set (the server reports unhealthy) and the loop stops.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RequestOutput
from pagellm.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; no request can run."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)
        self._stopped = False
        self.thread_cpu_seconds = 0.0
        """CPU time of the engine thread (its own, not torch's worker threads), per step."""
        self._queued: dict[str, int] = {}
        """Requests admitted but without a first output yet -> their prompt tokens (event loop)."""

    # ----- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()

    @property
    def is_healthy(self) -> bool:
        """False once a step failed, the engine thread stopped, or a part of the executor (a
        worker rank) died, even while no request is running."""
        return self.error is None and self._thread.is_alive() and self.engine.executor_healthy()

    @property
    def num_queued_requests(self) -> int:
        return len(self._queued)

    @property
    def num_queued_tokens(self) -> int:
        return sum(self._queued.values())

    # ----- requests (event-loop side) ---------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        tenant: str = "default",
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; raises RequestRejected at once for a
        request that can never run. Leaving the iteration early (a client went away, a
        cancelled task) aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if not self.engine.executor_healthy():
            raise EngineDeadError("engine stopped: a worker rank of this replica died")
        text, ids = self.engine.prepare_prompt(prompt)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            self._streams[request_id] = stream
        self._queued[request_id] = len(ids)
        self._inbox.put(_Add(request_id, text, ids, params, priority, tenant))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                self._queued.pop(request_id, None)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queued.pop(request_id, None)
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    # ----- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._apply_inbox(block=not self.engine.has_unfinished_requests())
                if self._stopped:
                    return
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                    self.thread_cpu_seconds = time.thread_time()
        except BaseException as exc:  # noqa: BLE001 - every stream must learn of it
            self.error = exc
            self._fail_all(exc)

    def _apply_inbox(self, block: bool) -> None:
        item = self._inbox.get() if block else self._get_nowait()
        while item is not None:
            if isinstance(item, _Add):
                self._add(item)
            else:
                self.engine.abort(item.request_id)
            item = self._get_nowait()

    def _get_nowait(self) -> _Add | _Abort | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _add(self, item: _Add) -> None:
        with self._streams_lock:
            if item.request_id not in self._streams:
                return  # the client left before the request reached the engine
        try:
            self.engine.add_request(
                item.request_id,
                item.prompt_ids,
                item.params,
                priority=item.priority,
                prompt_text=item.prompt_text,
                tenant=item.tenant,
            )
        except ValueError as exc:  # a duplicate id, say: that request fails, others run on
            self._deliver(item.request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineDeadError(f"engine stopped: {exc!r}")
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
