"""GGUF quantized tensors in pagellm's stored form, without dequantizing them (Q4_K and Q6_K,
the types of llama.cpp's Q4_K_M files, further down).

Q8_0 (blocks of 32: fp16 d, 32 int8; w = d * q), Q4_0 (fp16 d, 16 bytes of nibbles; w = d * (q - 8))
and Q4_1 (fp16 d, fp16 m, nibbles; w = d * q + m) keep their integers and fp16 scales; only the
layout changes (the scales move out of the blocks; the nibbles stay in GGUF's order, which is the
stored form's). Other types are
dequantized at load by the ``gguf`` package (``KEPT`` says which are kept).
"""

from __future__ import annotations

import numpy as np
import torch

from pagellm.quant.formats import QuantFormat, QuantizedWeight, pack_nibbles

BLOCK = 32
SUPER = 256
"""Inputs per K-quant super-block."""
KEPT = {
    "Q8_0": QuantFormat("gguf:Q8_0", bits=8, group_size=BLOCK, scale_dtype=torch.float16),
    "Q4_0": QuantFormat("gguf:Q4_0", bits=4, group_size=BLOCK, scale_dtype=torch.float16, zero=8),
    "Q4_1": QuantFormat(
        "gguf:Q4_1", bits=4, group_size=BLOCK, scale_dtype=torch.float16, offsets=True
    ),
    # K-quants: each sub-block's scale (d * sc) and minimum (dmin * m) are products of an fp16
    # and a 6- or 8-bit integer, so they are held as fp32; Q6_K's 6-bit values as int8
    "Q4_K": QuantFormat("gguf:Q4_K", bits=4, group_size=32, offsets=True),
    "Q6_K": QuantFormat("gguf:Q6_K", bits=8, group_size=16),
}


def kept_format(type_name: str) -> QuantFormat | None:
    """The stored form a GGUF tensor type is kept in, or None (dequantized at load)."""
    return KEPT.get(type_name)


def from_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's raw bytes ([rows, row bytes] uint8) as a ``QuantizedWeight``."""
    fmt = KEPT[type_name]
    if type_name == "Q4_K":
        return _q4_k(np.array(raw).reshape(rows * cols // SUPER, -1), fmt, rows, cols)
    if type_name == "Q6_K":
        return _q6_k(np.array(raw).reshape(rows * cols // SUPER, -1), fmt, rows, cols)
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


def _q4_k(blocks: np.ndarray, fmt: QuantFormat, rows: int, cols: int) -> QuantizedWeight:
    """Q4_K super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles): w = (d * sc) * q - dmin * m per 32 inputs, i.e. offset = -(dmin * m)."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    lo, hi, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    scales = d * sc.astype(np.float32)
    offsets = -(dmin * mins.astype(np.float32))
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    values = torch.from_numpy((qs & 0x0F).reshape(rows, cols).astype(np.uint8))
    return QuantizedWeight(
        fmt,
        pack_nibbles(values),
        torch.from_numpy(scales.reshape(rows, -1)).contiguous(),
        None,
        torch.from_numpy(offsets.reshape(rows, -1)).contiguous(),
    )


def _q6_k(blocks: np.ndarray, fmt: QuantFormat, rows: int, cols: int) -> QuantizedWeight:
    """Q6_K super-blocks (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16
    d): w = (d * sc) * (q - 32) per 16 inputs; the values are held as int8."""
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(
        1, 1, 2, 1
    )
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
        1, 1, 4, 1
    )
    q = ((ql & 0x0F).reshape(n, 256) | ((qh & 0x03).reshape(n, 256) << 4)).astype(np.int8) - 32
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    scales = (d * sc).reshape(rows, -1)
    values = torch.from_numpy(q.reshape(rows, cols).copy()).view(torch.uint8)
    return QuantizedWeight(fmt, values.contiguous(), torch.from_numpy(scales).contiguous())
