"""A worker rank's process: build this rank's part of the model and KV cache, report what it
holds, then run every step rank 0 sends down the pipe until told to stop (``None``) or until
rank 0 goes away (the pipe closes). A failure is reported up the pipe before the process exits,
so rank 0 can say which rank failed and why."""

from __future__ import annotations

import contextlib
import importlib
import pickle
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from pagellm.config import CacheConfig, StepLimits
from pagellm.parallel.layout import RankLayout


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    layout: RankLayout
    store_host: str
    """Rank 0's address (its rendezvous store)."""
    store_port: int
    model_source: str
    dtype: str
    cache: CacheConfig
    swap: bool
    timeout_s: float
    threads: int
    worker_cls: str = "auto"
    sys_path: tuple[str, ...] = ()
    """Extra import paths (a worker_cls outside the package)."""
    microbatches: int = 1
    own_host: str = "127.0.0.1"
    """The address this rank's gloo connections use (its node's address under Ray)."""
    device: str = "cpu"
    """cpu or cuda: the kind rank 0 resolved; every rank runs on the same kind."""
    device_index: int = 0
    """Which visible GPU this rank takes (its rank on one machine; 0 in a Ray actor, which
    sees only the GPU Ray gave it)."""
    limits: StepLimits = StepLimits()
    quantization: str | None = None
    """``--quantization`` as given (each rank resolves it against the same checkpoint)."""
    batch_invariant: bool = False
    """``--batch-invariant``: every rank computes with the batch-invariant kernels."""


@dataclass(frozen=True, slots=True)
class WorkerReport:
    rank: int
    num_blocks: int
    num_host_blocks: int
    memory: dict[str, int]
    node: str = "local"
    """The Ray node the rank runs on (``local`` for a spawned process)."""
    device: str = "cpu"


def runner_class(name: str) -> type:
    if name == "auto":
        from pagellm.runner.model_runner import ModelRunner

        return ModelRunner
    module, _, cls = name.partition(":")
    if not cls:
        raise ValueError(f"worker_cls takes module:Class, got {name!r}")
    return getattr(importlib.import_module(module), cls)


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    sys.path[:0] = list(spec.sys_path)
    try:
        runner = build_runner(spec)
        conn.send_bytes(pickle.dumps(report_of(spec.layout.rank, runner)))
        while True:
            try:
                step = pickle.loads(conn.recv_bytes())
            except EOFError:
                return  # rank 0 is gone
            if step is None:
                return
            runner.execute(step)
    except BaseException as exc:  # noqa: BLE001 - rank 0 must learn why this rank stopped
        message = f"rank {spec.layout.rank}: {exc!r}\n{traceback.format_exc(limit=4)}"
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(RuntimeError(message)))
        raise SystemExit(1) from exc


def build_runner(spec: WorkerSpec):
    """This rank's runner: join the groups, load this rank's part of the model."""
    import torch

    from pagellm.parallel.comm import Collectives, join_store
    from pagellm.runner.device import resolve_device
    from pagellm.runner.loader import open_model, resolve_dtype

    torch.set_num_threads(spec.threads)
    device = resolve_device(spec.device, spec.device_index)
    store = join_store(spec.store_host, spec.store_port, spec.layout.world_size, spec.timeout_s)
    comm = Collectives(spec.layout, store, spec.timeout_s, spec.own_host, device)
    files = open_model(Path(spec.model_source), spec.quantization)
    cls = runner_class(spec.worker_cls)
    dtype = resolve_dtype(spec.dtype, device)
    if not spec.batch_invariant:
        return cls(files, dtype, spec.cache, spec.swap, comm, spec.microbatches, device,
                   spec.limits)  # fmt: skip
    return cls(files, dtype, spec.cache, spec.swap, comm, spec.microbatches, device, spec.limits,
               batch_invariant=True)  # fmt: skip


def report_of(rank: int, runner, node: str = "local") -> WorkerReport:
    memory = runner.memory_bytes()
    return WorkerReport(
        rank, runner.num_blocks, runner.num_host_blocks, memory, node, str(runner.device)
    )
