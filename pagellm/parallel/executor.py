"""A replica whose model is split over several processes. Rank 0 lives in the engine's process
(and runs the scheduler once, there); the other ranks are worker processes, spawned here
(``--distributed-executor-backend mp``) or Ray actors on the replica's placement group (``ray``).
Each step rank 0 hands every worker the step's SchedulerOutput, then all ranks run the step
together; only rank 0 samples and nothing comes back from the workers. Any failure of a rank
(it exited, raised, or a collective timed out) fails the step with RankFailed, which the engine
turns into failed requests and an unhealthy replica."""

from __future__ import annotations

import os
import sys

import torch

from pagellm.config import CacheConfig, ParallelConfig, StepLimits
from pagellm.engine.outputs import RunnerOutput, SchedulerOutput
from pagellm.parallel.comm import LOOPBACK, Collectives, RankFailed, open_store
from pagellm.parallel.layout import RankLayout
from pagellm.parallel.ranks import ProcessRanks, RayRanks, WorkerRanks
from pagellm.parallel.worker import WorkerSpec, report_of
from pagellm.runner.loader import ModelFiles
from pagellm.runner.model_runner import ModelRunner


class ParallelExecutor:
    def __init__(
        self,
        files: ModelFiles,
        dtype_name: str,
        dtype: torch.dtype,
        cache: CacheConfig,
        swap: bool,
        parallel: ParallelConfig,
        device: torch.device | None = None,
        limits: StepLimits | None = None,
        batch_invariant: bool = False,
    ) -> None:
        device = device or torch.device("cpu")
        limits = limits or StepLimits()
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        world = tp * pp
        timeout = parallel.distributed_timeout
        backend = parallel.distributed_executor_backend
        if backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be mp or ray, not {backend!r}")
        on_ray = backend == "ray"
        host = _node_address() if on_ray else LOOPBACK
        threads = max(1, (os.cpu_count() or 1) // world)
        microbatches = parallel.pipeline_microbatches or pp
        self.store = open_store(world, timeout, host)
        self.failed: BaseException | None = None
        specs = [
            WorkerSpec(
                RankLayout(tp, pp, rank), host, self.store.port, str(files.path), dtype_name,
                cache, swap, timeout, threads, parallel.worker_cls, tuple(sys.path),
                microbatches=microbatches,
                own_host=host,  # a Ray worker rank replaces it with its own node's address
                device=device.type, device_index=rank, limits=limits,
                quantization=files.quant.method, batch_invariant=batch_invariant,
            )
            for rank in range(1, world)
        ]  # fmt: skip
        self.ranks: WorkerRanks = RayRanks(specs, timeout) if on_ray else ProcessRanks(specs)
        try:
            torch.set_num_threads(threads)  # rank 0 shares the cores with its workers
            comm = Collectives(RankLayout(tp, pp, 0), self.store, timeout, host, device)
            self.runner = ModelRunner(
                files, dtype, cache, swap, comm, microbatches, device, limits,
                batch_invariant=batch_invariant,
            )  # fmt: skip
            own = report_of(0, self.runner, _node_id() if on_ray else "local")
            self.reports = [own, *self.ranks.reports()]
        except BaseException as exc:
            self.failed = exc
            self.shutdown()
            dead = self.ranks.start_failures()
            if dead and not isinstance(exc, ValueError):  # a bad setting: rank 0 says which
                raise RankFailed(f"worker ranks failed to start: {', '.join(dead)}") from exc
            raise
        self.num_blocks = min(r.num_blocks for r in self.reports)
        """Every rank's cache holds at least this many blocks: the scheduler's pool."""
        self.num_host_blocks = min(r.num_host_blocks for r in self.reports)

    # ----- the Executor protocol ------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if self.failed is not None:
            raise RankFailed(f"the replica's ranks failed earlier: {self.failed}")
        try:
            self.ranks.check()
            self.ranks.send(sched)
            return self.runner.execute(sched)
        except (RankFailed, OSError) as exc:
            self.failed = self.ranks.explain(exc)
            raise self.failed from exc

    def healthy(self) -> bool:
        if self.failed is not None:
            return False
        try:
            self.ranks.ping()
        except RankFailed:
            return False
        return True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the workers to stop; kill those that do not (at once after a failure: a hung
        rank would never answer)."""
        self.ranks.shutdown(0.0 if self.failed is not None else timeout)


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
