"""The server's handle on one grammar compile worker (``compile_worker``): start, ask, kill.

A worker is ``python -P -c`` (not multiprocessing, so no script's main module is run again; no
working directory on its path), started on first use and asked one constraint at a time over a
socket. The deadline counts the worker's CPU time, not the wall clock: it runs at a lower
priority, so on a busy server a compile may wait without being expensive. Past the deadline in
CPU the worker is killed and the constraint refused (``CompileDeadline``); a worker that keeps
waiting for CPU past ``WALL_FACTOR`` times the deadline (at least a minute) is killed too, and
the compile is refused as the server's trouble (``CompileAborted``: retry later); one that
dies mid-compile costs that constraint alone (``CompileCrashed``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pagellm.structured.compile_worker import MAX_COMPILE_MEMORY, MAX_REPLY_BYTES
from pagellm.structured.params import (
    CompileAborted,
    CompileCrashed,
    CompileDeadline,
    StructuredOutputError,
)

MAX_COMPILE_SECONDS = 10.0
"""CPU seconds a constraint may take to compile (and be tried, ``probe_matching``): ordinary
schemas take milliseconds, a schema pattern ``.{0,2000}`` ~2 s, nested repetitions
``(.{0,10}){0,10}`` ~30 s and more (Zen 4)."""
WALL_FACTOR = 4.0
MIN_WALL_SECONDS = 60.0
"""A compile may wait ``WALL_FACTOR`` times its deadline in wall time for its CPU time, and
at least this long (a short deadline on a busy machine is still judged by CPU)."""
START_SECONDS = 300.0
"""How long a new worker may take to be ready (it imports xgrammar and torch: seconds, more on
a busy machine)."""
TOO_BIG_TO_SEND = object()
"""What ``CompileWorker.compile`` returns for a grammar that compiled but is not sent."""

_POLL_SECONDS = 0.25
_LOG = logging.getLogger(__name__)
_ENTRY = (
    "import sys; sys.path.append(sys.argv.pop(1)); "
    "from pagellm.structured.compile_worker import main; main()"
)
"""Run with ``python -P``; this package's root is searched last, for a server run from a
source tree."""


def cpu_seconds(pid: int) -> float | None:
    """The user + system CPU time of a process (Linux ``/proc``; None elsewhere or if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _expect(conn: Connection, word: bytes) -> None:
    """Wait (bounded) for the worker to say ``word``; EOFError if it does not."""
    if not conn.poll(START_SECONDS) or conn.recv_bytes(64) != word:
        raise EOFError


class CompileWorker:
    """One worker process: started on first use, asked one constraint at a time, killed when
    it misses the deadline and started again later. Its lock is held through a start or a
    compile; ``close`` may come from any thread."""

    def __init__(
        self,
        tokenizer_info: str,
        extra_memory: int = MAX_COMPILE_MEMORY,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[int], float | None] = cpu_seconds,
    ) -> None:
        """``tokenizer_info``: xgrammar's TokenizerInfo as JSON (the worker's compiler's);
        ``clock`` and ``cpu_clock`` (a pid's CPU seconds) measure the deadline."""
        self._info = tokenizer_info.encode()
        self._extra_memory = extra_memory
        self._max_reply = max_reply_bytes
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None before it starts or after it is stopped)."""
        process = self._process
        return process.pid if process is not None else None

    def compile(self, kind: str, text: str, any_whitespace: bool, timeout: float) -> Any:
        """The compiled grammar serialized (``TOO_BIG_TO_SEND``: it compiled within the bounds
        but is larger than the reply cap), or StructuredOutputError: the compiler's message,
        CompileDeadline past ``timeout`` CPU seconds, CompileCrashed, CompileAborted."""
        with self._lock:
            conn = self._start()
            try:
                conn.send((kind, text, any_whitespace))
                reply = self._reply(conn, kind, timeout)
            except StructuredOutputError:
                raise
            except (EOFError, OSError):
                code = self._stop()
                _LOG.warning("grammar compile worker failed on a %s constraint (exit code %s)",
                             kind, code)  # fmt: skip
                raise CompileCrashed(
                    f"the {kind} constraint cannot be compiled: the compiler failed on it "
                    f"(exit code {code})"
                ) from None
            except BaseException:  # the conversation is out of step: start afresh
                self._stop()
                raise
        if reply.startswith(b"ok:"):
            return reply[3:].decode()
        if reply == b"big":
            return TOO_BIG_TO_SEND
        raise StructuredOutputError(reply[3:].decode())

    def _reply(self, conn: Connection, kind: str, timeout: float) -> bytes:
        """The worker's answer, waited for until it has used ``timeout`` CPU seconds (or the
        wall clock, where CPU time cannot be read), and at most ``WALL_FACTOR`` times that."""
        pid = self.pid
        cpu_start = self._cpu_clock(pid) if pid is not None else None
        start = self._clock()
        while not conn.poll(_POLL_SECONDS):
            wall = self._clock() - start
            cpu = self._cpu_clock(pid) if cpu_start is not None else None
            used = wall if cpu is None else cpu - cpu_start
            if used > timeout:
                self._stop()
                _LOG.warning("grammar compile worker stopped: a %s constraint took over %g s",
                             kind, timeout)  # fmt: skip
                raise CompileDeadline(
                    f"the {kind} constraint is too expensive to compile: it took more than "
                    f"{timeout:g} s"
                )
            if wall > max(WALL_FACTOR * timeout, MIN_WALL_SECONDS):
                self._stop()
                raise CompileAborted(
                    f"the server is too busy to compile the {kind} constraint now (it had "
                    f"{used:.1f} s of CPU in {wall:.0f} s): retry later"
                )
        return conn.recv_bytes(self._max_reply + 3)

    def start(self) -> None:
        """Start the worker unless it runs, and wait until it is ready (bounded)."""
        with self._lock:
            self._start()

    def _start(self) -> Connection:
        process = self._process
        if self._conn is not None and process is not None and process.poll() is None:
            return self._conn
        if process is not None:  # died while idle: not the next constraint's fault
            _LOG.warning("grammar compile worker had exited (exit code %s)", process.poll())
        self._stop()
        if self._closed:
            raise CompileAborted("the grammar compiler is shut down")
        try:
            self._conn, theirs = multiprocessing.Pipe()
            root = str(Path(__file__).resolve().parents[2])
            limits = [self._extra_memory, self._max_reply, os.getpid()]
            args = [root, str(theirs.fileno()), *map(str, limits)]
            with theirs:
                self._process = subprocess.Popen(
                    [sys.executable, "-P", "-c", _ENTRY, *args],
                    stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
                )  # fmt: skip
            if self._closed:  # close() came while this started: it may not have seen it
                raise EOFError
            _expect(self._conn, b"started")  # then it reads what follows at once
            self._conn.send_bytes(self._info)
            _expect(self._conn, b"ready")
        except Exception as exc:  # noqa: BLE001 - EOF, OSError, or Popen's own refusals
            code = self._stop()
            _LOG.warning("grammar compile worker did not start (exit code %s): %r", code, exc)
            raise CompileAborted(f"the grammar compiler did not start (exit code {code})") from None
        return self._conn

    def close(self) -> None:
        """Kill the worker for good: a compile in progress fails (it sees the worker die),
        then the handle is released."""
        self._closed = True
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        with self._lock:
            self._stop()

    def _stop(self) -> int | None:
        """Kill the worker (a later compile starts another); its exit code."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        if process.poll() is None:
            process.kill()
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            return None
