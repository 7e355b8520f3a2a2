"""Grammar compilation in a child process, so that its time and memory are bounded.

xgrammar's compile time is not bounded by a constraint's size: a 100-byte schema pattern such as
``(.{0,10}){0,10}`` compiles for minutes, and a thread cannot be stopped. So every constraint is
compiled by a ``CompileWorker``: a child process (``python -m`` this module, so no script's
main module is imported again) that compiles one constraint at a time and answers with the
compiled grammar serialized. A worker that misses the deadline is killed, and its constraint
refused; one that crashes costs its constraint alone. The server keeps only the deserialized
grammar, whose matchers run in the engine.

Owns: the worker's side (``serve``: build the grammar, compile, serialize, within an address
space cap) and the parent's handle (``CompileWorker``: start, ask, kill).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from pagellm.structured.params import StructuredOutputError, map_schema_refs

MAX_COMPILE_SECONDS = 10.0
"""A constraint whose grammar takes longer than this to compile is refused (its worker killed):
ordinary schemas compile in milliseconds, a schema pattern ``.{0,2000}`` in ~2 s, nested
repetitions ``(.{0,10}){0,10}`` in ~30 s and more (Zen 4)."""
MAX_COMPILE_MEMORY = 2 << 30
"""Address space a compile may add to the worker's own, in bytes (its allocations fail past it)."""
MAX_GRAMMAR_BYTES = 64 << 20
"""A compiled grammar larger than this is refused (3,000 regex alternatives take ~0.3 MB,
``.{0,1000}`` ~3 MB)."""
START_SECONDS = 300.0
"""How long a new worker may take to be ready (it imports xgrammar and torch: seconds, more on
a busy machine)."""

_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


class CompileAborted(StructuredOutputError):
    """The worker did not answer (deadline, crash, no start): unlike the compiler's errors this
    says nothing certain of the constraint, so it is not cached."""


def _clean(exc: BaseException) -> str:
    """xgrammar's message without its time stamp and source line."""
    return _LOG_PREFIX.sub("", str(exc).strip()).strip()


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _local_ref(ref: str) -> str:
    """A reference into the schema itself; others (xgrammar would take them as any JSON, with
    a warning in the log) are refused: nothing is fetched."""
    if ref != "#" and not ref.startswith("#/"):
        raise StructuredOutputError(
            f"the JSON schema's $ref {ref[:200]!r} is not local: only references into the "
            "schema itself ('#' or '#/...') are supported"
        )
    return ref


def _json_schema_grammar(xgr: Any, schema: str, any_whitespace: bool) -> Any:
    """xgrammar's grammar of a schema, with JSON's own string characters: its rule for
    length-bounded strings excludes only the quote, backslash, CR and LF, so it lets other
    control characters through, which JSON forbids unescaped (parsers reject them)."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    text = str(grammar)
    fixed = text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def build(xgr: Any, compiler: Any, kind: str, text: str, any_whitespace: bool) -> Any:
    """Compile one constraint (``kind`` and ``spec_text`` of its StructuredOutputsParams);
    raises StructuredOutputError for one that is malformed, xgrammar's error otherwise."""
    if kind == "json":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise StructuredOutputError("the JSON schema must be an object")
        map_schema_refs(schema, _local_ref)
        return compiler.compile_grammar(_json_schema_grammar(xgr, text, any_whitespace))
    if kind == "json_object":  # an object (xgrammar's built-in JSON also takes arrays)
        return compiler.compile_grammar(
            _json_schema_grammar(xgr, '{"type": "object"}', any_whitespace)
        )
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    return compiler.compile_grammar(text)


def _answer(xgr: Any, compiler: Any, kind: str, text: str, any_ws: bool) -> tuple:
    """("ok", serialized grammar) or ("error", the client's message)."""
    try:
        compiled = build(xgr, compiler, kind, text, any_ws)
        size = int(compiled.memory_size_bytes)
        if size > MAX_GRAMMAR_BYTES:
            return ("error", f"the {kind} constraint compiles to {size >> 20} MiB of grammar "
                    f"(at most {MAX_GRAMMAR_BYTES >> 20} MiB)")  # fmt: skip
        return ("ok", compiled.serialize_json())
    except StructuredOutputError as exc:
        return ("error", str(exc))
    except MemoryError:
        return ("error", _too_much_memory(kind))
    except RecursionError:
        return ("error", f"the {kind} constraint nests too deeply to compile")
    except Exception as exc:  # noqa: BLE001 - xgrammar's errors are RuntimeErrors
        if "bad_alloc" in str(exc):  # C++ allocation failed: the address space cap
            return ("error", _too_much_memory(kind))
        return ("error", f"the {kind} constraint cannot be compiled: {_clean(exc)}")


def _too_much_memory(kind: str) -> str:
    return f"the {kind} constraint needs too much memory to compile"


def _cap_address_space(extra: int) -> None:
    """Let this process grow by ``extra`` bytes of address space and no more."""
    pages = int(open("/proc/self/statm").read().split()[0])  # noqa: SIM115
    limit = pages * os.sysconf("SC_PAGE_SIZE") + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _die_with_parent() -> None:
    """Linux: this process is killed when the process that started it ends (a compile that
    runs for minutes does not outlive the server)."""
    with contextlib.suppress(OSError, AttributeError):  # elsewhere: at its next read
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve(conn: Connection, extra_memory: int) -> None:
    """The worker's loop: xgrammar's TokenizerInfo as JSON first, then ``(kind, text,
    any_whitespace)`` in and an answer out, until the parent closes its end."""
    import xgrammar as xgr

    conn.send("started")
    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    if extra_memory and os.path.exists("/proc/self/statm"):
        _cap_address_space(extra_memory)
    conn.send("ready")
    while True:
        try:
            kind, text, any_ws = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_answer(xgr, compiler, kind, text, any_ws))


def _expect(conn: Connection, word: str) -> None:
    """Wait (bounded) for the worker to say ``word``; EOFError if it does not."""
    if not conn.poll(START_SECONDS) or conn.recv() != word:
        raise EOFError


class CompileWorker:
    """The parent's handle on one worker process: started on first use, asked one constraint
    at a time, killed when it misses the deadline and started again later. Its lock is held
    through a start or a compile; ``close`` may come from any thread."""

    def __init__(self, tokenizer_info: str, extra_memory: int = MAX_COMPILE_MEMORY) -> None:
        """``tokenizer_info``: xgrammar's TokenizerInfo as JSON (the worker's compiler's)."""
        self._info = tokenizer_info
        self._extra_memory = extra_memory
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None before it starts or after it is stopped)."""
        return self._process.pid if self._process is not None else None

    def compile(self, kind: str, text: str, any_whitespace: bool, timeout: float) -> str:
        """The compiled grammar serialized, or StructuredOutputError: the compiler's message,
        or a refusal once ``timeout`` seconds pass (the worker is killed) or it dies."""
        with self._lock:
            return self._compile(kind, text, any_whitespace, timeout)

    def _compile(self, kind: str, text: str, any_whitespace: bool, timeout: float) -> str:
        conn = self._start()
        try:
            conn.send((kind, text, any_whitespace))
            if not conn.poll(timeout):
                self._stop()
                raise CompileAborted(
                    f"the {kind} constraint is too expensive to compile: it took more than "
                    f"{timeout:g} s"
                )
            status, payload = conn.recv()
        except (EOFError, OSError):
            code = self._stop()
            raise CompileAborted(
                f"the {kind} constraint cannot be compiled: the compiler failed on it "
                f"(exit code {code})"
            ) from None
        if status != "ok":
            raise StructuredOutputError(payload)
        return payload

    def start(self) -> None:
        """Start the worker unless it runs, and wait until it is ready (bounded)."""
        with self._lock:
            self._start()

    def _start(self) -> Connection:
        if self._conn is not None:
            return self._conn
        if self._closed:
            raise CompileAborted("the grammar compiler is shut down")
        ours, theirs = socket.socketpair()
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", __name__, str(theirs.fileno()), str(self._extra_memory)]
        self._process = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()], env=env
        )
        theirs.close()
        self._conn = conn = Connection(ours.detach())
        try:
            if self._closed:  # close() came while this started: it may not have seen it
                raise EOFError
            _expect(conn, "started")  # then it reads what follows at once
            conn.send(self._info)
            _expect(conn, "ready")
        except (EOFError, OSError):
            code = self._stop()
            raise CompileAborted(f"the grammar compiler did not start (exit code {code})") from None
        return conn

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


if __name__ == "__main__":
    _die_with_parent()
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
