"""RMSNorm computed in float32 and cast back before the weight, as the Hugging Face reference.

On a CPU ``row_ops`` norms the rows with the C++ op captured decode steps use
(``pagellm.layers.row_ops``), so an eager and a captured step give the same bits; batch-invariant
mode relies on it (``pagellm.runner.batch_invariant``)."""

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
