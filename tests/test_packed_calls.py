"""Bound kernel calls run from C (pagellm/kernels/packed.py, packed_call.h): the same results
as through ctypes, float arguments included, runs of them merged around Python calls, and the
first failing status returned."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels.decode_ops import load_decode_ops
from pagellm.kernels.packed import BoundCall, run_from_c


@pytest.fixture(scope="module")
def ops():
    ops = load_decode_ops()
    if ops is None:
        pytest.skip("no C++ compiler")
    return ops


def _norm_call(ops, x, residual, weight, out, eps, code=0):
    rows, hidden = x.shape
    return ops.bound(ops.add_rms_norm, code, x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                     out.data_ptr(), rows, hidden, eps, 1)  # fmt: skip


def test_packed_calls_compute_what_their_ctypes_calls_do(ops):
    """An add + RMSNorm (a float eps far from the default, so that a wrong float word shows)
    and a SiLU-and-multiply, run once through ctypes and once from C on copies of the inputs."""
    torch.manual_seed(0)
    x, weight = torch.randn(3, 64), torch.rand(64) + 0.5
    gate_up = torch.randn(3, 128)
    results = []
    for from_c in (False, True):
        residual, normed, act = (
            torch.randn(3, 64).mul_(0).add_(1.5),
            torch.empty(3, 64),
            torch.empty(3, 64),
        )
        calls = [
            _norm_call(ops, x, residual, weight, normed, 0.75),
            ops.bound(ops.silu_mul, 0, gate_up.data_ptr(), act.data_ptr(), 3, 64, 1),
        ]
        assert all(isinstance(c, BoundCall) for c in calls)
        plan = run_from_c(calls, ops.run_calls) if from_c else calls
        assert len(plan) == (1 if from_c else 2)
        assert all(call() == 0 for call in plan)
        results.append((residual.clone(), normed.clone(), act.clone()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    summed = x + 1.5
    ref = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 0.75) * weight
    torch.testing.assert_close(results[1][1], ref)


def test_python_calls_split_the_runs_and_a_failure_stops_the_run(ops):
    x, weight, residual, out = (
        torch.randn(1, 16),
        torch.ones(16),
        torch.zeros(1, 16),
        torch.empty(1, 16),
    )
    seen = []

    def python_work() -> int:
        seen.append(out.clone())
        return 0

    good = [_norm_call(ops, x, residual, weight, out, 1e-5) for _ in range(3)]
    plan = run_from_c([good[0], good[1], python_work, good[2]], ops.run_calls)
    assert len(plan) == 3 and plan[1] is python_work and plan[2] is good[2]  # a lone call stays
    assert [call() for call in plan] == [0, 0, 0] and len(seen) == 1
    # an unknown dtype code: status 1 from the second call, the third never runs
    residual.zero_()
    bad = _norm_call(ops, x, residual, weight, out, 1e-5, code=7)
    (run,) = run_from_c([good[0], bad, good[1]], ops.run_calls)
    assert run() == 1
    torch.testing.assert_close(residual, x)  # only the first call added x
