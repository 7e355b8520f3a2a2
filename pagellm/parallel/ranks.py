"""How rank 0 reaches its worker ranks: as spawned processes on this machine (``mp``, with a
pipe each) or as Ray actors on the bundles of the replica's placement group (``ray``; the ranks
may then sit on other nodes). Either way rank 0 hands each worker the step, learns of a worker
that died or raised, and stops them; the step's tensors travel over the gloo groups, not here."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
from multiprocessing.connection import Connection
from typing import Any, Protocol

from pagellm.engine.outputs import SchedulerOutput
from pagellm.parallel.comm import RankFailed
from pagellm.parallel.worker import WorkerReport, WorkerSpec, run_worker


class WorkerRanks(Protocol):
    def reports(self) -> list[WorkerReport]: ...

    def send(self, sched: SchedulerOutput | None) -> None: ...

    def check(self) -> None:
        """Raise RankFailed if a worker is known to have stopped (cheap: runs every step)."""
        ...

    def ping(self) -> None:
        """Like check, and also look for ranks that died while idle (health checks)."""
        ...

    def explain(self, exc: BaseException) -> RankFailed: ...

    def pids(self) -> list[int]: ...

    def shutdown(self, timeout: float) -> None: ...


class ProcessRanks:
    """Worker ranks as spawned processes on this machine, each fed through a pipe."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        ctx = mp.get_context("spawn")
        self.workers: list[tuple[mp.Process, Connection]] = []
        for spec in specs:
            ours, theirs = ctx.Pipe()
            name = f"pagellm-rank{spec.layout.rank}"
            proc = ctx.Process(target=run_worker, args=(spec, theirs), name=name, daemon=True)
            proc.start()
            theirs.close()
            self.workers.append((proc, ours))

    def reports(self) -> list[WorkerReport]:
        out = []
        for proc, conn in self.workers:
            try:
                message = pickle.loads(conn.recv_bytes())
            except EOFError:
                raise RankFailed(f"{proc.name} exited ({proc.exitcode}) while loading") from None
            if isinstance(message, BaseException):
                raise RankFailed(str(message))
            out.append(message)
        return out

    def send(self, sched: SchedulerOutput | None) -> None:
        step = pickle.dumps(sched)
        for _, conn in self.workers:
            conn.send_bytes(step)

    def check(self) -> None:
        for proc, _ in self.workers:
            if not proc.is_alive():
                raise RankFailed(f"{proc.name} exited with code {proc.exitcode}")

    def ping(self) -> None:
        self.check()  # a process's liveness is known without asking it

    def explain(self, exc: BaseException) -> RankFailed:
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

    def pids(self) -> list[int]:
        return [proc.pid for proc, _ in self.workers]

    def start_failures(self) -> list[str]:
        return [f"{p.name} (exit code {p.exitcode})" for p, _ in self.workers if p.exitcode]

    def shutdown(self, timeout: float) -> None:
        for proc, conn in self.workers:
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send_bytes(pickle.dumps(None))
        for proc, conn in self.workers:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
            conn.close()


class RankActor:
    """A worker rank inside a Ray actor (``ray.remote`` is applied by RayRanks)."""

    def __init__(self, spec: WorkerSpec) -> None:
        import dataclasses
        import os

        import ray

        from pagellm.parallel.worker import build_runner, report_of

        # Ray shows this actor only the GPU it gave it (CUDA_VISIBLE_DEVICES): index 0
        spec = dataclasses.replace(spec, own_host=ray.util.get_node_ip_address(), device_index=0)
        self.runner = build_runner(spec)
        node = ray.get_runtime_context().get_node_id()
        self._report = report_of(spec.layout.rank, self.runner, node)
        self.pid = os.getpid()

    def report(self) -> WorkerReport:
        return self._report

    def get_pid(self) -> int:
        return self.pid

    def execute(self, sched: SchedulerOutput) -> str | None:
        """Run the step; on failure answer why, then leave (so rank 0's collectives fail at
        once instead of waiting for their timeout)."""
        import os
        import threading
        import traceback

        try:
            self.runner.execute(sched)
            return None
        except BaseException as exc:  # noqa: BLE001 - rank 0 must learn why this rank stopped
            threading.Timer(0.2, os._exit, args=(1,)).start()
            return f"{exc!r}\n{traceback.format_exc(limit=4)}"


class RayRanks:
    """Worker ranks as Ray actors, rank k on bundle k of the current placement group (so a
    replica's ranks go where its placement group put them, across nodes if it spread them).
    Outside one (``--distributed-executor-backend ray`` on its own), the ranks get a placement
    group of their own, a CPU (and on GPUs a GPU) per worker rank, removed at shutdown."""

    def __init__(self, specs: list[WorkerSpec], timeout: float) -> None:
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.timeout = timeout
        if not ray.is_initialized():  # joins RAY_ADDRESS's cluster, else starts one here
            ray.init(include_dashboard=False, logging_level="warning")
        current = get_current_placement_group()
        self.own_group = None if current is not None else _own_group(specs, timeout * 5)
        group = current or self.own_group
        first = 0 if current is not None else 1  # rank 0 has no bundle in a group of our own
        self.actors = []
        for spec in specs:
            index = spec.layout.rank - first
            bundle = dict(group.bundle_specs[index])
            strategy = PlacementGroupSchedulingStrategy(group, index)
            options: dict[str, Any] = {
                "num_cpus": bundle.pop("CPU", 0), "num_gpus": bundle.pop("GPU", 0),
                "resources": {k: v for k, v in bundle.items() if not k.startswith("bundle")},
                "max_restarts": 0, "scheduling_strategy": strategy,
            }  # fmt: skip
            self.actors.append(ray.remote(RankActor).options(**options).remote(spec))
        self._pending: list[Any] = []
        self._pings: list[Any] = []

    def reports(self) -> list[WorkerReport]:
        import ray

        try:
            return ray.get([a.report.remote() for a in self.actors], timeout=self.timeout * 5)
        except Exception as exc:  # noqa: BLE001 - Ray wraps the worker's own error
            raise RankFailed(f"a worker rank failed while loading: {exc}") from exc

    def send(self, sched: SchedulerOutput | None) -> None:
        if sched is not None:
            self._pending = [a.execute.remote(sched) for a in self.actors]

    def check(self) -> None:
        """Raise RankFailed if the last step came back with an error (on the step path: no
        new Ray calls here)."""
        self._raise_if_failed(self._pending)

    def ping(self) -> None:
        """Raise RankFailed if the last liveness ping failed, then ping again once it is
        answered: a rank that dies while the replica is idle is seen by the next health check."""
        import ray

        self._raise_if_failed(self._pings)
        if not self._pings or not ray.wait(self._pings, num_returns=len(self._pings), timeout=0)[1]:
            self._pings = [a.get_pid.remote() for a in self.actors]

    def _raise_if_failed(self, refs: list[Any]) -> None:
        import ray

        if not refs:
            return
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            problem = self._outcome(ref)
            if problem:
                raise RankFailed(problem)

    def _outcome(self, ref: Any) -> str | None:
        import ray

        try:
            answer = ray.get(ref, timeout=0)
        except Exception as exc:  # noqa: BLE001 - the actor died: Ray says how
            return f"a worker rank died: {type(exc).__name__}"
        return f"a worker rank failed: {answer}" if isinstance(answer, str) else None

    def explain(self, exc: BaseException) -> RankFailed:
        import ray

        if self._pending:
            done, _ = ray.wait(self._pending, num_returns=len(self._pending), timeout=1.0)
            for ref in done:
                problem = self._outcome(ref)
                if problem:
                    return RankFailed(f"{problem} (seen as: {exc})")
        return exc if isinstance(exc, RankFailed) else RankFailed(str(exc))

    def pids(self) -> list[int]:
        import ray

        return ray.get([a.get_pid.remote() for a in self.actors], timeout=self.timeout)

    def start_failures(self) -> list[str]:
        return []

    def shutdown(self, timeout: float) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.own_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.own_group)
            self.own_group = None


def _own_group(specs: list[WorkerSpec], timeout: float) -> Any:
    """A placement group for worker ranks started outside any: one bundle per rank."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = {"CPU": 1.0, **({"GPU": 1.0} if specs[0].device == "cuda" else {})}
    group = placement_group([dict(bundle) for _ in specs], strategy="PACK")
    if not group.wait(timeout):
        remove_placement_group(group)
        raise RankFailed(f"Ray cannot place {len(specs)} worker ranks of {bundle} each")
    return group
