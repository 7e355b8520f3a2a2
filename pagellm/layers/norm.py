"""RMSNorm computed in float32 and cast back before the weight, as the Hugging Face reference.

In batch-invariant mode ``row_ops`` norms the rows (``pagellm.runner.batch_invariant``: on a CPU
the C++ op captured decode steps use, so an eager and a captured step give the same bits)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.row_ops: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_ops is not None:
            return self.row_ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # torch's rms_norm accumulates in the input dtype: bf16 sums lose the answer
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
