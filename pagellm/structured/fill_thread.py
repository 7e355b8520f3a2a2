"""Grammar matching off the engine thread, so that a step that runs long can be left behind.

A bitmask fill's time does not follow anything checked before it: a grammar can force 24 cheap
tokens and then reach a state whose one fill takes minutes (``[0-9]{24}((.{0,18}){0,18}){0,18}``
took 138 s), past the compile worker's trial walk. xgrammar releases the GIL while it matches,
so the engine hands each request's matching to a ``FillThread`` and waits at most a bound; past
it the request fails, and the thread, still matching, is left to finish at the lowest priority
(Linux: its own nice value) while a new thread takes the next requests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_LOG = logging.getLogger(__name__)
_LOWEST_PRIORITY = 19


class FillTimeout(Exception):
    """The matching ran past its bound; the thread doing it was left behind."""


class FillThread:
    """One thread that runs matching jobs in turn, replaced when a job overruns."""

    def __init__(self) -> None:
        self.abandoned = 0
        """Threads left behind so far (each was still matching when its bound passed)."""
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    def run(self, job: Callable[[], Any], timeout: float) -> Any:
        """``job()``'s result, run on the thread; FillTimeout if it takes over ``timeout``
        seconds (the job's own exceptions are raised here)."""
        if self._jobs is None:
            self._start()
        assert self._jobs is not None
        future: Future = Future()
        self._jobs.put((job, future))
        try:
            return future.result(timeout)
        except TimeoutError:
            self._abandon()
            raise FillTimeout(f"matching took more than {timeout:g} s") from None

    def close(self) -> None:
        """Let the thread end once its queued jobs are done."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = self._thread = None

    def _start(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs,), name="pagellm-grammar-fill", daemon=True
        )
        self._thread.start()

    def _abandon(self) -> None:
        thread = self._thread
        self.close()
        self.abandoned += 1
        if thread is not None and thread.native_id is not None:
            with contextlib.suppress(OSError, AttributeError):  # per-thread nice: Linux
                os.setpriority(os.PRIO_PROCESS, thread.native_id, _LOWEST_PRIORITY)
        _LOG.warning("grammar matching overran its bound; its thread is left to finish")


def _serve(jobs: queue.SimpleQueue) -> None:
    while (item := jobs.get()) is not None:
        job, future = item
        try:
            future.set_result(job())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting engine thread
            future.set_exception(exc)
