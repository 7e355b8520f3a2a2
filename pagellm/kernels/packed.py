"""Kernel calls bound once, runnable from Python or, many in a row, from C.

A captured decode step (``pagellm.runner.captured``) is a list of about 270 bare kernel calls
at one stream (SmolLM2's 30 layers), and each ctypes call costs about a microsecond of Python
before the kernel starts. A ``BoundCall`` keeps its ctypes function and arguments (call it:
the kernel runs through ctypes) and the same arguments packed as 64-bit words for the
library's ``<name>_packed`` entry (packed_call.h); ``run_from_c`` turns each run of consecutive
bound calls of a list into one call of ``decode_run_calls``, which runs them in order from C.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from typing import Any

Call = Callable[[], Any]


def _word(argtype: Any, value: Any) -> int:
    """One argument as the signed 64-bit word that packed_call.h unpacks."""
    if argtype is ctypes.c_float:
        return struct.unpack("<i", struct.pack("<f", value))[0]
    if argtype is ctypes.c_double:
        return struct.unpack("<q", struct.pack("<d", value))[0]
    if argtype is ctypes.c_void_p:
        return 0 if value is None else int(value)
    if argtype in (ctypes.c_int, ctypes.c_int64, ctypes.c_int32):
        return int(value)
    raise TypeError(f"no packed form for a {argtype} argument")


class BoundCall:
    """``fn(*args)`` of a kernel library's ctypes function, and its packed form."""

    def __init__(self, lib: ctypes.CDLL, fn: Any, args: Sequence[Any]) -> None:
        self.fn, self.args = fn, tuple(args)
        packed = getattr(lib, f"{fn.__name__}_packed")
        self.entry = ctypes.cast(packed, ctypes.c_void_p).value
        words = [_word(t, a) for t, a in zip(fn.argtypes, self.args, strict=True)]
        self.words = (ctypes.c_int64 * len(words))(*words)

    def __call__(self) -> int:
        return self.fn(*self.args)


class _CallsFromC:
    """Bound calls run in order by one call of the runner (their first non-zero status)."""

    def __init__(self, runner: Any, calls: list[BoundCall]) -> None:
        self.calls = calls  # the packed words stay alive with them
        n = len(calls)
        self._args = (
            n,
            (ctypes.c_void_p * n)(*(c.entry for c in calls)),
            (ctypes.POINTER(ctypes.c_int64) * n)(
                *(ctypes.cast(c.words, ctypes.POINTER(ctypes.c_int64)) for c in calls)
            ),
        )
        self._runner = runner

    def __call__(self) -> int:
        return self._runner(*self._args)


def run_from_c(calls: list[Call], runner: Any) -> list[Call]:
    """``calls`` with each run of two or more consecutive ``BoundCall``s replaced by one call
    of ``runner`` (``decode_run_calls``); other calls (Python work) stay where they are."""
    out: list[Call] = []
    pending: list[BoundCall] = []

    def flush() -> None:
        if len(pending) > 1:
            out.append(_CallsFromC(runner, list(pending)))
        else:
            out.extend(pending)
        pending.clear()

    for call in calls:
        if isinstance(call, BoundCall):
            pending.append(call)
            continue
        flush()
        out.append(call)
    flush()
    return out
