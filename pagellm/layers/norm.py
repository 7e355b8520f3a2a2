"""RMSNorm computed in float32 and cast back before the weight, as the Hugging Face reference.

In batch-invariant mode (``row_ops`` set) every row is normed by the C++ op that captured decode
steps use, so that a row's result is the same in an eager step and in a captured one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.decode_ops import DTYPE_CODES, DecodeOps


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.row_ops: DecodeOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_ops is not None:
            return self._rows(x)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # torch's rms_norm accumulates in the input dtype: bf16 sums lose the answer
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.shape[-1]
        rows = x.reshape(-1, hidden).contiguous()
        out = torch.empty_like(rows)
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        rc = self.row_ops.add_rms_norm(DTYPE_CODES[x.dtype], rows.data_ptr(), None,
                                       weight.data_ptr(), out.data_ptr(), rows.shape[0], hidden,
                                       self.eps, torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_add_rms_norm failed with code {rc}")
        return out.view(x.shape)
