"""An asyncio front for the engine: per-request output streams over a background step loop.

One thread owns the ``LLMEngine`` and runs ``step()`` while there is work, so the event loop never
waits for a model step. The event loop only validates and posts adds and aborts to an inbox that
the engine thread applies between steps (all aborts of one drain in one pass): an abort frees its
KV blocks before the next step runs. Prompts are tokenized by the caller, off the event loop.

A stream holds at most the latest output of its request: outputs are cumulative, so a reader
that falls behind skips to the newest one, and a stalled reader costs O(1) memory per stream.

If a step raises, every stream gets the error, ``error`` is set (the server reports unhealthy)
and the loop stops. A fault of one request alone (its sampling, its detokenization) fails only
that request: its stream raises ``RequestFailed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagellm.engine.errors import RequestRejected
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RequestOutput
from pagellm.engine.sampling_params import SamplingParams
from pagellm.openmp_env import release_thread_pool

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; no request can run."""


class RequestFailed(RuntimeError):
    """One request failed on a fault of its own (the engine runs on)."""


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
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps; its result (or error) goes to
    ``future`` on ``loop``."""

    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class _Stream:
    """The newest output (or error) of one request, handed from the engine thread to a reader
    on the event loop; the engine thread never waits and never queues more than one item."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ready = asyncio.Event()
        self._lock = threading.Lock()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._wake_pending = False

    def push(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: replace what the reader has not taken yet, and wake it once."""
        with self._lock:
            if isinstance(item, BaseException):
                self._error = item
            else:
                self._latest = item
            if self._wake_pending:
                return
            self._wake_pending = True
        with contextlib.suppress(RuntimeError):  # the reader's loop is closed: nobody reads
            self.loop.call_soon_threadsafe(self.ready.set)

    def take(self) -> tuple[RequestOutput | None, BaseException | None]:
        """Event loop: what arrived since the last take."""
        with self._lock:
            self._wake_pending = False
            self.ready.clear()
            latest, self._latest = self._latest, None
            return latest, self._error


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        """Guards ``_streams`` and the queued counts (both threads touch them)."""
        self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)
        self._stopped = False
        self.thread_cpu_seconds = 0.0
        """CPU time of the engine thread (its own, not torch's worker threads), per step."""
        self._queued: dict[str, tuple[int, int]] = {}
        """Requests admitted but without a first output yet -> (sequences, prompt tokens)."""
        self._queued_seqs = 0
        self._queued_tokens = 0

    # ----- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        # the model was loaded on this thread: its idle OpenMP pool would make the engine
        # thread's workers sleep between parallel regions (see release_thread_pool)
        release_thread_pool()
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
        """Sequences (a request with ``n`` counts ``n``) admitted without a first output."""
        return self._queued_seqs

    @property
    def num_queued_tokens(self) -> int:
        return self._queued_tokens

    # ----- requests (event-loop side) ---------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        tenant: str = "default",
        prompt_text: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request now (it counts as queued from this call on) and return the stream
        of its outputs. Iterate it to the end, or leave it early to abort the request; a
        stream never iterated still ends when its request does."""
        self._check_alive()
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._count_queued(request_id, (params.n, len(prompt_ids)))
        self._inbox.put(_Add(request_id, prompt_text, prompt_ids, params, priority, tenant))
        return self._outputs(request_id, stream)

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        tenant: str = "default",
    ) -> AsyncIterator[RequestOutput]:
        """Tokenize (here, on the loop: for callers that do not mind), submit and stream a
        request; raises RequestRejected at once for a request that can never run."""
        self._check_alive()
        text, ids = self.engine.prepare_prompt(prompt)
        self.engine.check_params(params)
        async for out in self.submit(request_id, ids, params, priority, tenant, text):
            yield out

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """``fn(engine)`` run on the engine thread between two steps (so it sees a consistent
        state, e.g. for a snapshot), awaited here."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Call(fn, loop, future))
        return await future

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if not self.engine.executor_healthy():
            raise EngineDeadError("engine stopped: a worker rank of this replica died")

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                await stream.ready.wait()
                out, error = stream.take()
                if out is not None:
                    finished = out.finished
                    if out.error is not None and out.error_is_bad_request:
                        raise RequestRejected(out.error)
                    if out.error is not None:
                        raise RequestFailed(out.error)
                    yield out
                if error is not None and not finished:
                    raise error
        finally:
            self._forget(request_id)
            if not finished:
                self._inbox.put(_Abort(request_id))

    # ----- bookkeeping (both threads, under the lock) ----------------------------------

    def _count_queued(self, request_id: str, entry: tuple[int, int]) -> None:
        self._queued[request_id] = entry
        self._queued_seqs += entry[0]
        self._queued_tokens += entry[1]

    def _unqueue(self, request_id: str) -> None:
        seqs, tokens = self._queued.pop(request_id, (0, 0))
        self._queued_seqs -= seqs
        self._queued_tokens -= tokens

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self._unqueue(request_id)

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
            log.exception("the engine stopped; every request fails until a restart")
            self.error = exc
            self._fail_all(exc)

    def _apply_inbox(self, block: bool) -> None:
        item = self._inbox.get() if block else self._get_nowait()
        aborts: list[str] = []
        while item is not None:
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _Call):
                _run_call(item, self.engine)
            else:
                aborts.append(item.request_id)
            item = self._get_nowait()
        if aborts:
            self.engine.abort_requests(aborts)

    def _get_nowait(self) -> _Add | _Abort | _Call | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _add(self, item: _Add) -> None:
        with self._lock:
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
        except Exception as exc:  # noqa: BLE001 - that request fails, the others run on
            self._deliver(item.request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            self._unqueue(request_id)
            ended = isinstance(item, BaseException) or item.finished
            if ended:  # the reader may never come: nothing of it stays here
                self._streams.pop(request_id, None)
        if stream is not None:
            stream.push(item)

    def _fail_all(self, exc: BaseException) -> None:
        error = EngineDeadError(f"engine stopped: {exc!r}")
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.push(error)
        while (item := self._get_nowait()) is not None:  # what was queued for the dead thread
            if isinstance(item, _Call):
                _settle(item, None, error)
            elif isinstance(item, _Add):  # registered after the streams above were read
                self._deliver(item.request_id, error)


def _run_call(item: _Call, engine: LLMEngine) -> None:
    try:
        result, error = item.fn(engine), None
    except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine runs on
        result, error = None, exc
    _settle(item, result, error)


def _settle(item: _Call, result: Any, error: BaseException | None) -> None:
    """Hand ``item``'s result or error to its future, on its loop."""

    def settle() -> None:
        if item.future.done():
            return
        if error is not None:
            item.future.set_exception(error)
        else:
            item.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed
        item.loop.call_soon_threadsafe(settle)
