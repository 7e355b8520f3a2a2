"""Runners that fail on purpose, for the worker ranks of the parallel tests (``worker_cls``)."""

from __future__ import annotations

import time

from pagellm.engine.outputs import RunnerOutput, SchedulerOutput
from pagellm.runner.model_runner import ModelRunner

FAIL_AT_STEP = 3


class RaisingRunner(ModelRunner):
    """Raises in its third step, before the step's first collective."""

    steps = 0

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        if self.steps >= FAIL_AT_STEP:
            raise RuntimeError("injected worker failure")
        return super().execute(sched)


class HangingRunner(ModelRunner):
    """Stops answering in its third step (a stuck rank: alive, silent)."""

    steps = 0

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        if self.steps >= FAIL_AT_STEP:
            time.sleep(3600)
        return super().execute(sched)
