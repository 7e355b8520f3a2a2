"""RMSNorm and SiLU-and-multiply by the C++ ops of captured decode steps, for eager forwards.

On a CPU every ``RMSNorm`` and MLP of a float32 / bf16 model gets ``CpuRowOps`` as its
``row_ops``: an eager step (a prefill, a long prompt's chunks) then norms and activates its rows
with the same fused ops a captured decode step runs, one pass each instead of torch's chain of
element-wise ops (a float32 copy, pow, mean, rsqrt, two products, a bf16 copy for a bf16 norm;
SiLU, a product and their copies for the MLP): ad-hoc, a 1024-token bf16 prefill of SmolLM2 on
the 2-core Xeon 214 -> 201 ms. Batch-invariant mode relies on the same ops row by row
(``pagellm.runner.batch_invariant``).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels.decode_ops import DTYPE_CODES, DecodeOps
from pagellm.layers.norm import RMSNorm


class CpuRowOps:
    """RMSNorm and SiLU-and-multiply by the C++ ops of captured decode steps, row by row."""

    def __init__(self, ops: DecodeOps) -> None:
        self.ops = ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden).contiguous()
        out = torch.empty_like(rows)
        weight = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        rc = self.ops.add_rms_norm(DTYPE_CODES[x.dtype], rows.data_ptr(), None, weight.data_ptr(),
                                   out.data_ptr(), rows.shape[0], hidden, eps,
                                   torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_add_rms_norm failed with code {rc}")
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        act = torch.empty(gate_up.shape[0], intermediate, dtype=gate_up.dtype)
        rc = self.ops.silu_mul(DTYPE_CODES[act.dtype], gate_up.data_ptr(), act.data_ptr(),
                               act.shape[0], intermediate, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_silu_mul failed with code {rc}")
        return act


def use_row_ops(model: nn.Module, row_ops: object) -> int:
    """Give every ``RMSNorm`` and every module with a ``row_ops`` slot (the MLPs) of ``model``
    these ops; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, RMSNorm) or hasattr(module, "row_ops"):
            module.row_ops = row_ops
            count += 1
    return count
