"""The Triton prefill kernel (what a GPU runs) under TRITON_INTERPRET=1 on the CPU: against the
same float64 reference as the C++ kernel, and wired into the attention backend."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

triton = pytest.importorskip("triton", reason="Triton is installed by `make test`")

from test_paged_prefill_kernel import _run_case  # noqa: E402

from pagellm.attention.backend import SeqLayout  # noqa: E402
from pagellm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagellm.attention.triton_prefill import TritonPrefillKernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _OnDevice:
    """Runs the kernel on DEVICE with host tensors in and out (the reference is on the host)."""

    def __init__(self, kernel: TritonPrefillKernel) -> None:
        self.kernel = kernel

    def __call__(self, q, k_cache, v_cache, tables, starts, pos, out, scale):
        args = [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, starts, pos, out)]
        self.kernel(*args, scale)
        out.copy_(args[-1].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("hkv", "group", "d"), [(2, 3, 64), (1, 8, 128), (2, 1, 80)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_matches_the_reference(dtype, hkv, group, d, block_size):
    kernel = _OnDevice(TritonPrefillKernel(block_m=16, block_n=16))
    chunks = [(0, 20), (37, 1), (block_size + 3, 17)]
    _run_case(kernel, dtype, hkv, group, d, block_size, chunks, seed=d + group)


def test_the_backend_sends_every_prefill_chunk_to_the_kernel_in_one_call():
    hq, hkv, d, bs, blocks = 6, 2, 64, 16, 32
    calls = []
    kernel = TritonPrefillKernel(block_m=16, block_n=16)

    def counting(*args):
        calls.append(args[4].shape[0] - 1)
        return kernel(*args)

    counting.supports = kernel.supports  # type: ignore[attr-defined]
    backend = TorchAttentionBackend(hq, hkv, d, bs, torch.float32, prefill_kernel=counting)
    reference = TorchAttentionBackend(hq, hkv, d, bs, torch.float32)
    gen = torch.Generator().manual_seed(5)
    (cache,) = backend.allocate_cache(1, blocks)
    (ref_cache,) = reference.allocate_cache(1, blocks)
    for t, ref_t in zip(cache, ref_cache, strict=True):
        t.copy_(torch.randn(t.shape, generator=gen))
        ref_t.copy_(t)
    seqs = [SeqLayout(1, 20, [3, 4]), SeqLayout(9, 0, [7]), SeqLayout(12, 30, [0, 1, 2])]
    n = sum(s.num_tokens for s in seqs)
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    out = backend.forward(cache, q, k, v, backend.build_metadata(seqs, blocks))
    expected = reference.forward(ref_cache, q, k, v, reference.build_metadata(seqs, blocks))
    assert calls == [2]  # the two prefill chunks, together
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
