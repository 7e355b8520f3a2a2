"""GGUF quantized tensors in pagellm's stored form, without dequantizing them.

Q8_0 (blocks of 32: fp16 d, 32 int8; w = d * q), Q4_0 (fp16 d, 16 bytes of nibbles; w = d * (q - 8))
and Q4_1 (fp16 d, fp16 m, nibbles; w = d * q + m) keep their integers and fp16 scales; only the
layout changes (the scales move out of the blocks; the nibbles stay in GGUF's order, which is the
stored form's). Other types are
dequantized at load by the ``gguf`` package (``KEPT`` says which are kept).
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.quant.formats import QuantFormat, QuantizedWeight

BLOCK = 32
KEPT = {
    "Q8_0": QuantFormat("gguf:Q8_0", bits=8, group_size=BLOCK, scale_dtype=torch.float16),
    "Q4_0": QuantFormat("gguf:Q4_0", bits=4, group_size=BLOCK, scale_dtype=torch.float16, zero=8),
    "Q4_1": QuantFormat(
        "gguf:Q4_1", bits=4, group_size=BLOCK, scale_dtype=torch.float16, offsets=True
    ),
}


def kept_format(type_name: str) -> QuantFormat | None:
    """The stored form a GGUF tensor type is kept in, or None (dequantized at load)."""
    return KEPT.get(type_name)


def from_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's raw bytes ([rows, row bytes] uint8) as a ``QuantizedWeight``."""
    fmt = KEPT[type_name]
    blocks = torch.from_numpy(np.array(raw).reshape(rows, cols // BLOCK, -1))
    scales = blocks[..., 0:2].contiguous().view(torch.float16).reshape(rows, -1)
    if type_name == "Q8_0":
        q = blocks[..., 2:].contiguous().reshape(rows, cols)
        return QuantizedWeight(fmt, q, scales.clone())
    offsets = None
    if type_name == "Q4_1":
        offsets = blocks[..., 2:4].contiguous().view(torch.float16).reshape(rows, -1).clone()
        packed = blocks[..., 4:]
    else:
        packed = blocks[..., 2:]
    # GGUF's nibble order (byte j: elements j and j + 16) is the stored form's: kept as it is
    q = packed.contiguous().reshape(rows, cols // 2)
    return QuantizedWeight(fmt, q, scales.clone(), None, offsets)
