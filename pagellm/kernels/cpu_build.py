"""Compile our C++ CPU kernels once (g++, cached by source hash) and load them with ctypes.

Plain C ABI, no torch headers: a build takes about a second. When no compiler is available the
callers fall back to the pure-PyTorch path, so the kernels are an accelerator, never a need.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from pagellm.fetch import cache_dir

log = logging.getLogger(__name__)

# Reassociation lets g++ vectorize the dot products; no -ffast-math (it assumes no infinities).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fPIC",
    "-shared",
    "-std=c++17",
    "-pthread",
]


def build_library(source_name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Compile ``source_name`` (next to this file) into the cache; None if that fails.

    ``extra_flags`` (e.g. ``-DPAGELLM_VEC_WIDTH=16``) build a variant with its own cache entry."""
    if os.environ.get("PAGELLM_DISABLE_CPU_KERNELS") == "1":
        return None
    source = Path(__file__).with_name(source_name)
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        log.warning("no C++ compiler found: using the PyTorch attention path")
        return None
    # -march=native: a library built on one CPU may not run on another, so the CPU is in the key
    flags = [*_FLAGS, *extra_flags]
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = source.read_bytes() + headers + " ".join(flags).encode() + _cpu_flags().encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, *flags, str(source), "-o", str(built)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                log.warning("building %s failed: %s", source.name, proc.stderr[-2000:])
                return None
            built.replace(target)  # atomic: concurrent builders never load a partial file
    return ctypes.CDLL(str(target))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX): torch's bf16 GEMMs are
    then faster than fp32 ones; elsewhere they are emulated and slower."""
    flags = _cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _cpu_flags() -> str:
    """The instruction-set flags of this CPU (Linux), or "" where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
