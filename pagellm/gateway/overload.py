"""The gateway's overload queue: requests that arrive while every replica serving their model is
saturated wait here, in one line per model, first come first served within it, until a replica
has room or their time runs out. Only the request at the head of its model's line may leave, so a
newcomer never overtakes a waiting one, and a saturated model never holds back another model's
requests. Deadlines use the injected clock; waiters wake when a replica frees a slot or a health
check changes what the replicas report."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class AdmissionQueue:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._lines: dict[str | None, deque[object]] = {}
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def waiting(self, model: str | None) -> int:
        """Requests waiting for this model."""
        return len(self._lines.get(model, ()))

    def notify(self) -> None:
        """Something changed (a slot freed, loads re-read): every waiter looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_turn(
        self, has_room: Callable[[], bool], timeout: float, model: str | None = None
    ) -> bool:
        """Wait until this request is at the head of its model's line and ``has_room()``; False
        on timeout. On True the caller must take its slot before it next awaits (nothing else
        runs in between)."""
        ticket = object()
        line = self._lines.setdefault(model, deque())
        line.append(ticket)
        deadline = self.clock() + timeout
        try:
            while not (line[0] is ticket and has_room()):
                left = deadline - self.clock()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    return False
            return True
        finally:
            line.remove(ticket)
            if not line:  # the model's line is in the map exactly while someone waits in it
                del self._lines[model]
            self.notify()  # the next in line may go now
