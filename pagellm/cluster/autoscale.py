"""The replica autoscaler's rule, on an injected clock (plain Python, no Ray): one replica more
when the waiting requests per replica have stayed above a depth for ``upscale_delay`` seconds,
one fewer when no request has been waiting or running for ``downscale_delay`` seconds, always
within [min_replicas, max_replicas]. One step at a time, so a burst does not overshoot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Load:
    replicas: int
    waiting: float
    """Requests queued at the replicas (and at the gateway)."""
    running: float


class Autoscaler:
    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        queue_depth: float,
        upscale_delay: float,
        downscale_delay: float,
        clock: Callable[[], float],
    ) -> None:
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.queue_depth = queue_depth
        self.upscale_delay, self.downscale_delay = upscale_delay, downscale_delay
        self.clock = clock
        self._busy_since: float | None = None
        self._idle_since: float | None = None

    def desired(self, load: Load) -> int:
        now = self.clock()
        current = load.replicas
        if current < self.min_replicas:
            return self.min_replicas
        if current > self.max_replicas:
            return self.max_replicas
        busy = load.waiting / max(1, current) > self.queue_depth
        self._busy_since = _since(self._busy_since, now) if busy else None
        idle = load.waiting == 0 and load.running == 0
        self._idle_since = _since(self._idle_since, now) if idle else None
        if busy and current < self.max_replicas and now - self._busy_since >= self.upscale_delay:
            self._busy_since = None  # the next step waits a full delay again
            return current + 1
        if idle and current > self.min_replicas and now - self._idle_since >= self.downscale_delay:
            self._idle_since = None
            return current - 1
        return current


def _since(started: float | None, now: float) -> float:
    return now if started is None else started
