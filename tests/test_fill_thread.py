"""The fill thread's batches: one handoff for a step's jobs, each job bounded on its own; an
overrun ends the batch at that job and leaves its thread behind (a clock the jobs move)."""

import os
import threading
import time

from pagellm.structured.fill_thread import FillThread, FillTimeout

FILL_THREAD = "pagellm-grammar-fill"


class JobClock:
    """The bounds' clock: moved only by the jobs below, so a test's outcome does not depend
    on how fast the machine is."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_batch_runs_in_order_on_one_thread_and_returns_results_and_exceptions():
    fills = FillThread()
    seen = []

    def job(value):
        seen.append(threading.current_thread().name)
        if value == "bad":
            raise ValueError("bad row")
        return value * 2

    results = fills.run_each([lambda v=v: job(v) for v in (1, "bad", 3)], timeout=5.0)
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError)
    assert seen == [FILL_THREAD] * 3
    assert fills.run_each([], timeout=5.0) == []
    assert fills.abandoned == 0
    fills.close()


def test_each_job_has_its_own_bound_not_the_batch():
    """Three jobs of 0.2 s each by the bounds' clock against a 0.25 s bound: 0.6 s in all,
    none past its own. Each also sleeps 0.2 s of real time, so the engine thread wakes (after
    0.25 s) while the batch still runs and judges the job running then."""
    clock = JobClock()
    fills = FillThread(monotonic=clock)

    def job(i):
        clock.now += 0.2
        time.sleep(0.2)
        return i

    assert fills.run_each([lambda i=i: job(i) for i in range(3)], timeout=0.25) == [0, 1, 2]
    assert fills.abandoned == 0
    fills.close()


def test_an_overrun_ends_the_batch_there_and_leaves_its_thread_behind():
    clock, release, dropped = JobClock(), threading.Event(), []
    fills = FillThread(monotonic=clock)

    def stuck():
        clock.now += 1.0  # past the bound at once, and it does not return until released
        release.wait(60)
        return "late"

    jobs = [lambda: "first", stuck, lambda: dropped.append("ran") or "third"]
    others = set(threading.enumerate())  # threads left by other tests may still be filling
    try:
        results = fills.run_each(jobs, timeout=0.25)
        assert results[0] == "first" and isinstance(results[1], FillTimeout)
        assert len(results) == 2 and fills.abandoned == 1
        (left,) = [t for t in set(threading.enumerate()) - others if t.name == FILL_THREAD]
        assert left.is_alive()  # still stuck in its job
        assert fills.left_running() == 1
        assert _metrics(fills) == {"overruns": 1.0, "left": 1.0}
        if hasattr(os, "getpriority"):  # Linux: that thread alone at the lowest priority
            assert os.getpriority(os.PRIO_PROCESS, left.native_id) == 19
        # the caller runs what came after on a new thread, while the old one is still stuck
        assert fills.run_each(jobs[2:], timeout=0.25) == ["third"]
    finally:
        release.set()
    left.join(60)
    assert not left.is_alive() and fills.left_running() == 0
    assert _metrics(fills) == {"overruns": 1.0, "left": 0.0}
    assert dropped == ["ran"]  # only the new thread ran it: the old one stopped after "late"
    fills.close()


def _metrics(fills: FillThread) -> dict[str, float]:
    """What /metrics shows of these fills (the server registers the same collector)."""
    from prometheus_client import CollectorRegistry

    from pagellm.server.metrics import FillThreadCollector

    registry = CollectorRegistry()
    registry.register(FillThreadCollector(fills, "m"))
    label = {"model_name": "m"}
    return {
        "overruns": registry.get_sample_value(
            "pagellm:structured_output_match_overruns_total", label
        ),
        "left": registry.get_sample_value("pagellm:structured_output_fill_threads_left", label),
    }
