"""Every C++ kernel source compiles where there is a compiler. A kernel that fails to build
makes its loader return None: the engine falls back to torch and the kernel's own tests skip,
so a compile error would otherwise pass unnoticed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pagellm.kernels import cpu_build

SOURCES = sorted(p.name for p in Path(cpu_build.__file__).parent.glob("*.cpp"))


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None
    or os.environ.get("PAGELLM_DISABLE_CPU_KERNELS") == "1",
    reason="no C++ compiler, or the kernels are switched off",
)
@pytest.mark.parametrize("source", SOURCES)
def test_kernel_source_builds(source):
    assert cpu_build.build_library(source, ("-fopenmp",)) is not None, f"{source} did not build"
