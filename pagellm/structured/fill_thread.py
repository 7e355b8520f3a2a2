"""Grammar matching off the engine thread, so that a step that runs long can be left behind.

A bitmask fill's time does not follow anything checked before it: a grammar can force 24 cheap
tokens and then reach a state whose one fill takes minutes (``[0-9]{24}((.{0,18}){0,18}){0,18}``
took 138 s), past the compile worker's trial walk. xgrammar releases the GIL while it matches,
so the engine hands a step's matching to a ``FillThread`` as one batch of jobs (one per
sequence) and bounds each job; past the bound that job fails, and the thread, still matching,
is left to finish at the lowest priority (Linux: nice 19 for that thread) while a new thread
takes the batch's remaining jobs. One handoff a step, not one a sequence: the engine thread
sleeps until the batch is done, waking early only to look at a job that may have run past its
bound.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_LOG = logging.getLogger(__name__)
_LOWEST_PRIORITY = 19


class FillTimeout(Exception):
    """The matching ran past its bound; the thread doing it was left behind."""


@dataclass(slots=True)
class _Batch:
    """Jobs in flight on one thread. ``lock`` guards ``started``, ``results`` and
    ``abandoned``: the fill thread appends a result and starts the next job's time in one
    update, so the running job is always ``results``' length; the engine thread reads them to
    judge that job and sets ``abandoned`` when it gives up on it."""

    jobs: list[Callable[[], Any]]
    started: float
    """When the running job began (for job 0: when the batch was handed over)."""
    results: list[Any] = field(default_factory=list)
    """Each finished job's result or exception, in order."""
    abandoned: bool = False
    """The engine gave up on the running job: the thread must drop its result and stop."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)


class FillThread:
    """One thread that runs batches of matching jobs, replaced when a job overruns."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``monotonic``: the clock the bounds are judged by; the engine thread waits the
        seconds it says are left as real seconds (tests pass one their jobs move)."""
        self.abandoned = 0
        """Threads left behind so far (each was still matching when its bound passed)."""
        self._left: list[threading.Thread] = []
        self._left_lock = threading.Lock()  # the server counts them from its own thread
        self._monotonic = monotonic
        self._jobs: queue.SimpleQueue[_Batch | None] | None = None
        self._thread: threading.Thread | None = None

    def run_each(self, jobs: list[Callable[[], Any]], timeout: float) -> list[Any]:
        """Run ``jobs`` in order on the thread; each one's result, or the exception it raised.
        A job still running ``timeout`` seconds after it began gets a FillTimeout and ends the
        list there (its thread is left behind): the caller decides what runs after it."""
        if not jobs:
            return []
        if self._jobs is None:
            self._start()
        assert self._jobs is not None and self._thread is not None
        batch, thread = _Batch(jobs, started=self._monotonic()), self._thread
        self._jobs.put(batch)
        while not batch.done.wait(self._time_left(batch, timeout)):
            with batch.lock:
                if batch.done.is_set() or self._monotonic() - batch.started < timeout:
                    continue  # finished meanwhile, or a later job is running: wait for it
                batch.abandoned = True
                # still in its job (it cannot leave the batch without this lock), so its
                # thread id is still its own
                _lowest_priority(thread.native_id)
                results = [*batch.results, FillTimeout(f"matching took more than {timeout:g} s")]
            self._abandon(thread)
            return results
        return batch.results

    def left_running(self) -> int:
        """How many threads left behind are still matching (each until its one fill ends, at
        the lowest priority: minutes for the worst grammars)."""
        with self._left_lock:
            self._left = [thread for thread in self._left if thread.is_alive()]
            return len(self._left)

    def close(self) -> None:
        """Let the thread end once its queued jobs are done."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = self._thread = None

    def _time_left(self, batch: _Batch, timeout: float) -> float:
        with batch.lock:
            started = batch.started
        return max(0.0, started + timeout - self._monotonic())

    def _start(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs, self._monotonic), name="pagellm-grammar-fill",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _abandon(self, thread: threading.Thread) -> None:
        self.close()
        self.abandoned += 1
        with self._left_lock:
            self._left.append(thread)
        self.left_running()  # prunes the ended ones: the offline LLM never asks otherwise
        _LOG.warning("grammar matching overran its bound; its thread is left to finish")


def _lowest_priority(thread_id: int | None) -> None:
    """Nice 19 for one thread (Linux). Not SCHED_IDLE: the thread takes the GIL back for a
    moment when its fill ends, and a SCHED_IDLE thread preempted then on busy cores could keep
    the engine thread waiting for the GIL far longer."""
    if thread_id is not None:
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, thread_id, _LOWEST_PRIORITY)


def _serve(jobs: queue.SimpleQueue[_Batch | None], monotonic: Callable[[], float]) -> None:
    while (batch := jobs.get()) is not None:
        _run_batch(batch, monotonic)


def _run_batch(batch: _Batch, monotonic: Callable[[], float]) -> None:
    for index, job in enumerate(batch.jobs):
        try:
            result = job()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting engine thread
            result = exc
        with batch.lock:  # one update: the running job is always len(results), or none is
            if batch.abandoned:
                return  # the engine has moved on without this job's result
            batch.results.append(result)
            if index + 1 < len(batch.jobs):
                batch.started = monotonic()
            else:
                batch.done.set()
