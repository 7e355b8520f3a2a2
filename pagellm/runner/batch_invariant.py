"""Batch-invariant mode (``--batch-invariant``): a request's logits, bit for bit, do not depend on
what else shares its steps (how many rows, its place among them, prefill or decode, chunked or
whole, a prefix-cache hit or a fresh prefill, after preemption, the TP all-reduce).

What varies with the batch in the default mode, and what this mode puts in its place:
- linear layers: oneDNN picks its GEMM blocking from the shape (on this project's Xeon a row's
  bf16 result already differs between 1 and 64 rows of the LM head) -> ``invariant_linear.cpp``,
  one fixed K order per output element for any number of rows (AMX / AVX-512 BF16 / FMA);
- attention: prefill chunks go through the tiled prefill kernel, decode rows through the decode
  kernel, with different summation orders -> every token is a row of the decode kernel, which
  reads keys in an order set by the row's position alone (and splits a long context over threads
  by its length, not by the batch: ``fixed_split``);
- RMSNorm and SiLU-and-multiply: on a CPU eager and captured steps alike run the fused C++ ops
  of captured steps, row by row (``pagellm.layers.row_ops``, the default there too); on a GPU
  the norms take a Triton kernel with one program per row;
- the TP all-reduce: a ring starts each element's sum at a rank set by its place in the tensor
  -> an all-gather summed in rank order.
The sampler already works row by row (softmax, log-softmax, top-k/top-p sorts, per-request
seeded generators), and embeddings and rotary are exact element-wise ops.

On a GPU the same switch takes Triton kernels with fixed tiles (``pagellm.kernels.
triton_invariant``: the linear layers and RMSNorm) and sends every token, decodes included, to the
Triton prefill kernel, whose key tiles start at position 0 in every call.

The guarantee holds on one machine with one build: another CPU kind takes another kernel path
(AMX vs AVX-512 BF16 vs FMA) and another library version may round differently.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.decode_ops import load_decode_ops
from pagellm.kernels.invariant_linear import load_invariant_linear_kernel
from pagellm.layers.linear import Linear
from pagellm.layers.quant_linear import QuantEmbedding, QuantPart
from pagellm.layers.row_ops import CpuRowOps, use_row_ops

log = logging.getLogger(__name__)


class TritonRowOps:
    """RMSNorm in Triton, one program per row; SiLU-and-multiply is element-wise (the same bits
    in any batch) and stays torch's."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from pagellm.kernels.triton_invariant import triton_rms_norm

        return triton_rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        gate, up = gate_up.split(intermediate, dim=-1)
        return F.silu(gate) * up


def make_batch_invariant(model: nn.Module, device: torch.device | None = None) -> str:
    """Switch ``model`` (loaded) to batch-invariant kernels; returns the linear kernel's name.
    Raises ValueError where the mode cannot hold. (The TP all-reduce's order is the runner's:
    ``Collectives.fixed_order``.)"""
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantPart | QuantEmbedding)]
    if quantized:
        raise ValueError(
            "--batch-invariant computes with dense weights: this model keeps "
            f"{quantized[0]} quantized (use --quantization none for a GGUF file, or a dense "
            "checkpoint)"
        )
    kernel, row_ops = _kernels(device or torch.device("cpu"))
    embedding = getattr(model, "embed_tokens", None)
    shared = {id(embedding.weight)} if embedding is not None else set()
    for module in model.modules():
        if isinstance(module, Linear):
            module.use_invariant(kernel, release_weight=id(module.weight) not in shared)
    use_row_ops(model, row_ops)  # the norms and the MLP's SiLU-and-multiply
    log.info("batch-invariant mode: linear layers on the %s path", kernel.path_name)
    return kernel.path_name


def _kernels(device: torch.device):
    if device.type == "cuda":
        from pagellm.kernels.triton_invariant import TritonInvariantLinear, triton_available

        if not triton_available():
            raise ValueError("--batch-invariant on a GPU needs Triton")
        return TritonInvariantLinear(), TritonRowOps()
    kernel = load_invariant_linear_kernel()
    ops = load_decode_ops()
    if kernel is None or ops is None:
        raise ValueError("--batch-invariant needs the C++ CPU kernels, which did not build")
    return kernel, CpuRowOps(ops)
