"""OpenMP wait policy for this process, set before torch loads its OpenMP runtime, and the
release of a thread's idle OpenMP pool (``release_thread_pool``).

After each parallel region, libgomp's idle threads spin (GOMP_SPINCOUNT, 300k by default)
before sleeping. Our decode-attention kernel runs on its own threads between torch ops, and on a
machine with few cores those spinning torch threads take the cores it needs. A short spin keeps
torch's wake-up cheap and gives the cores back quickly: measured here, decode steps of 256
sequences take 0.32-0.34 s with 2000 spins against 0.38-0.44 s with the default.
A value the user already set is kept; importing torch before pagellm leaves the default.
"""

from __future__ import annotations

import ctypes
import os
import sys

DEFAULT_SPINCOUNT = "2000"


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
