"""Keep freed memory in the process heap (glibc) so per-step temporaries do not page-fault.

glibc serves large allocations with fresh mmap()s and returns them to the OS on free; a step that
allocates tens of MB of activations then pays page faults for every byte, every step. Turning
mmap off for allocations and disabling trimming keeps that memory mapped and reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_heap_memory() -> bool:
    """Returns whether glibc accepted the settings (False on other C libraries)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok_trim = mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    ok_mmap = mallopt(_M_MMAP_MAX, 0)
    return bool(ok_trim and ok_mmap)
