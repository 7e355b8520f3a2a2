"""The process groups of one replica and the collectives its ranks use, every one bounded by a
timeout so that a dead or stuck rank surfaces as an error instead of a hang.

Groups are built from a TCP store held by rank 0 (on loopback, or on its node's address when
the ranks are Ray actors that may sit on other nodes), without torch.distributed's
global default group (several replicas or test engines may live in one process). CPU ranks use
gloo; GPU ranks (one card each) use NCCL with blocking waits, so that a timeout raises here
instead of NCCL's watchdog tearing the process down.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from pagellm.parallel.layout import RankLayout

LOOPBACK = "127.0.0.1"


class RankFailed(RuntimeError):
    """A collective failed or timed out: another rank died, raised, or hangs."""


def open_store(world_size: int, timeout_s: float, host: str = LOOPBACK) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of ``host`` (``store.port`` for the workers)."""
    return dist.TCPStore(
        host, 0, world_size, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, False, datetime.timedelta(seconds=timeout_s))


def _gloo(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float, host: str):
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


def _nccl(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float):
    if not dist.is_nccl_available():
        raise RuntimeError(f"torch {torch.__version__} has no NCCL: GPU ranks cannot talk")
    # read when the group is made: wait() then blocks and raises on timeout or a peer's
    # failure, and the watchdog only cleans up instead of tearing the process down
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, options)


class Collectives:
    """What one rank can say to the others inside a step: all-reduce and all-gather within its
    TP group, and activations to and from its peers in other stages. (The step itself reaches
    the workers through a pipe, which may wait forever: an idle replica is not a failure.)"""

    def __init__(
        self,
        layout: RankLayout,
        store: dist.Store | None,
        timeout_s: float,
        host: str = LOOPBACK,
        device: torch.device | None = None,
    ) -> None:
        self.layout = layout
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self.store = store  # kept alive as long as the groups made from it
        self.world = None
        self.tp = None
        self.fixed_order = False
        """All-reduce sums in rank order (``all_reduce``); the runner sets it in
        batch-invariant mode."""

        def group(prefix: str, rank: int, size: int):
            if self.device.type == "cuda":
                return _nccl(store, prefix, rank, size, timeout_s)
            return _gloo(store, prefix, rank, size, timeout_s, host)

        if layout.world_size > 1:
            self.world = group("world", layout.rank, layout.world_size)
        if layout.tp_size > 1:
            self.tp = group(f"tp{layout.stage}", layout.tp_rank, layout.tp_size)

    @classmethod
    def single(cls) -> Collectives:
        return cls(RankLayout(), None, 0.0)

    def barrier(self, name: str, timeout_s: float = 3600.0) -> None:
        """Wait (through the store, up to ``timeout_s``) until every rank has reached ``name``."""
        if self.store is None or self.layout.world_size == 1:
            return
        self.store.set(f"{name}/{self.layout.rank}", "1")
        keys = [f"{name}/{r}" for r in range(self.layout.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # a rank never got there (died while loading)
            raise RankFailed(f"ranks did not all reach {name!r}: {exc}") from exc

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise RankFailed(f"{what} failed (rank {self.layout.rank}): {exc}") from exc

    # ----- tensor parallel ------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group, in place (bf16 is summed in float32 and cast back). With
        ``fixed_order`` (batch-invariant mode) every element is summed in rank order: a ring
        all-reduce starts each element's sum at a rank set by where the element falls in the
        tensor, so by the tensor's size (the batch)."""
        if self.tp is None:
            return x
        if self.fixed_order:
            parts = [torch.empty_like(x) for _ in range(self.layout.tp_size)]
            self._wait(self.tp.allgather([parts], [x.contiguous()]), "all-gather")
            total = parts[0].float()
            for part in parts[1:]:
                total += part.float()
            return x.copy_(total)
        wide = x.float() if x.dtype == torch.bfloat16 else x
        self._wait(self.tp.allreduce([wide]), "all-reduce")
        if wide is not x:
            x.copy_(wide)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the TP group's tensors along the last dimension, in rank order."""
        if self.tp is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.layout.tp_size)]
        self._wait(self.tp.allgather([parts], [x]), "all-gather")
        return torch.cat(parts, dim=-1)

    # ----- the pipeline ------------------------------------------------------------------

    def isend(self, x: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor, int]:
        """Start sending ``x``; finish with ``wait_sends`` (which keeps ``x`` alive till then)."""
        x = x.contiguous()
        return self.world.send([x], dst, 0), x, dst

    def wait_sends(self, sends: list[tuple[Any, torch.Tensor, int]]) -> None:
        for work, _, dst in sends:
            self._wait(work, f"send to rank {dst}")

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self._wait(self.world.recv([out], src, 0), f"receive from rank {src}")
        return out
