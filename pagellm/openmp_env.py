"""OpenMP wait policy for this process, set before torch loads its OpenMP runtime, and the
release of a thread's idle OpenMP pool (``release_thread_pool``).

After each parallel region, libgomp's idle workers spin GOMP_SPINCOUNT times, then sleep on a
futex; the next region has to wake them, which costs tens of microseconds on a virtual CPU. A
decode step is hundreds of parallel regions (every kernel and GEMM of every layer) with a little
Python between them, so the spin has to outlast those gaps, and between steps the host work
(well under a millisecond). Every kernel of ours runs on torch's own pool (libgomp by soname), so
a spinning worker never takes a core from another pool of ours. Measured on a 2-core Xeon (AMX),
bf16: ``pagellm serve`` at 8 streams 210 -> 280 out tok/s (mean step 27.7 -> 20.5 ms) going from
2000 spins to 30000, equal to libgomp's own 300000; offline 256 x 128/128 1215 -> 1351 tok/s.
30000 spins (a millisecond or two) give the cores back soon after the engine goes idle, which
matters where several processes share few cores (tests, a gateway beside its replicas). A value
the user already set is kept; importing torch before pagellm leaves libgomp's default.
"""

from __future__ import annotations

import ctypes
import os
import sys

DEFAULT_SPINCOUNT = "30000"


def apply_openmp_defaults() -> bool:
    """Returns whether the setting could still take effect (torch not imported yet)."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault("GOMP_SPINCOUNT", DEFAULT_SPINCOUNT)
    return True


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads of the calling thread (``omp_pause_resource_all``).

    libgomp keeps a pool of workers for every thread that ever started a parallel region, and
    while the pools hold more threads than there are CPUs its workers spin only ~100 times
    before sleeping, so every parallel region of a step pays a futex wake. A server loads the
    model on its main thread and steps it on the engine thread: two pools on two cores made
    the engine thread's steps ~1.5x slower (1.05 of 2 cores used; 22.8 vs 33.9 tok/s at one
    stream). The main thread calls this before handing the engine over. Returns whether a
    pool was released (False without libgomp, e.g. a torch built with another OpenMP)."""
    try:
        lib = ctypes.CDLL("libgomp.so.1")  # by soname: the one torch loaded
    except OSError:
        return False
    pause = getattr(lib, "omp_pause_resource_all", None)
    if pause is None:
        return False
    pause.restype = ctypes.c_int
    return pause(2) == 0  # omp_pause_hard
