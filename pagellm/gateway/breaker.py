"""A per-replica circuit breaker: closed -> open after N consecutive failures -> half-open probe
after a cool-down -> closed on success (open again on failure). Time comes from an injected clock.
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self, clock: Callable[[], float], failure_threshold: int = 3, reset_after: float = 5.0
    ) -> None:
        self.clock = clock
        self.failure_threshold = failure_threshold
        self.reset_after = reset_after
        self.failures = 0
        self.opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self.opened_at >= self.reset_after:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allows(self) -> bool:
        """Whether a request may go to the replica now (one probe at a time when half-open)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._probing:
            self._probing = True
            return True
        return False

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self._probing = False

    def record_failure(self) -> None:
        self.failures += 1
        self._probing = False
        if self.opened_at is not None or self.failures >= self.failure_threshold:
            self.opened_at = self.clock()  # (re)open: a failed probe restarts the cool-down
