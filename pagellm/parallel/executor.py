"""A replica whose model is split over several processes. Rank 0 lives in the engine's process
(and runs the scheduler once, there); the other ranks are spawned worker processes. Each step
rank 0 sends the step's SchedulerOutput down every worker's pipe, then all ranks run the step
together; only rank 0 samples and nothing comes back from the workers. Any failure of a rank
(it exited, raised, or a collective timed out) fails the step with RankFailed, which the engine
turns into failed requests and an unhealthy replica."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import sys
from multiprocessing.connection import Connection

import torch

from pagellm.config import CacheConfig, ParallelConfig
from pagellm.engine.outputs import RunnerOutput, SchedulerOutput
from pagellm.parallel.comm import Collectives, RankFailed, open_store
from pagellm.parallel.layout import RankLayout
from pagellm.parallel.worker import WorkerReport, WorkerSpec, run_worker
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
    ) -> None:
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        world = tp * pp
        timeout = parallel.distributed_timeout
        threads = max(1, (os.cpu_count() or 1) // world)
        self.store = open_store(world, timeout)
        ctx = mp.get_context("spawn")
        self.workers: list[tuple[mp.Process, Connection]] = []
        self.failed: BaseException | None = None
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            spec = WorkerSpec(
                RankLayout(tp, pp, rank), self.store.port, str(files.path), dtype_name,
                cache, swap, timeout, threads, parallel.worker_cls, tuple(sys.path),
            )  # fmt: skip
            proc = ctx.Process(
                target=run_worker, args=(spec, theirs), name=f"pagellm-rank{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            self.workers.append((proc, ours))
        try:
            torch.set_num_threads(threads)  # rank 0 shares the cores with its workers
            comm = Collectives(RankLayout(tp, pp, 0), self.store, timeout)
            self.runner = ModelRunner(files, dtype, cache, swap, comm)
            own = WorkerReport(0, *self._counts(self.runner), self.runner.memory_bytes())
            self.reports = [own, *(self._receive_report(p, c) for p, c in self.workers)]
        except BaseException as exc:
            self.failed = exc
            self.shutdown()
            dead = [f"{p.name} (exit code {p.exitcode})" for p, _ in self.workers if p.exitcode]
            if dead:
                raise RankFailed(f"worker ranks failed to start: {', '.join(dead)}") from exc
            raise
        self.num_blocks = min(r.num_blocks for r in self.reports)
        """Every rank's cache holds at least this many blocks: the scheduler's pool."""
        self.num_host_blocks = min(r.num_host_blocks for r in self.reports)

    @staticmethod
    def _counts(runner: ModelRunner) -> tuple[int, int]:
        return runner.num_blocks, runner.num_host_blocks

    def _receive_report(self, proc: mp.Process, conn: Connection) -> WorkerReport:
        """The worker's report once its part of the model is loaded (or why it failed)."""
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:
            raise RankFailed(f"{proc.name} exited ({proc.exitcode}) while loading") from None
        if isinstance(message, BaseException):
            raise RankFailed(str(message))
        return message

    # ----- the Executor protocol ------------------------------------------------------------

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if self.failed is not None:
            raise RankFailed(f"the replica's ranks failed earlier: {self.failed}")
        try:
            self._check_workers()
            step = pickle.dumps(sched)
            for _, conn in self.workers:
                conn.send_bytes(step)
            return self.runner.execute(sched)
        except (RankFailed, OSError) as exc:
            self.failed = self._explain(exc)
            raise self.failed from exc

    def healthy(self) -> bool:
        return self.failed is None and all(p.is_alive() for p, _ in self.workers)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the workers to stop; kill those that do not (at once after a failure: a hung
        rank would never answer)."""
        if self.failed is not None:
            timeout = 0.0
        for proc, conn in self.workers:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send_bytes(pickle.dumps(None))
        for proc, conn in self.workers:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
            conn.close()

    # ----- failures ------------------------------------------------------------------------

    def _check_workers(self) -> None:
        for proc, _ in self.workers:
            if not proc.is_alive():
                raise RankFailed(f"{proc.name} exited with code {proc.exitcode}")

    def _explain(self, exc: BaseException) -> RankFailed:
        """The first worker's own account of its failure, when one came up its pipe."""
        for proc, conn in self.workers:
            try:
                if conn.poll(0.5 if not proc.is_alive() else 0):
                    message = pickle.loads(conn.recv_bytes())
                    if isinstance(message, BaseException):
                        return RankFailed(f"{message} (seen as: {exc})")
            except (EOFError, OSError):
                continue
        return exc if isinstance(exc, RankFailed) else RankFailed(str(exc))
