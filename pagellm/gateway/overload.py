"""The gateway's overload queue: requests that arrive while every replica is saturated wait here,
first come first served, until a replica has room or their time runs out. Only the request at the
head may leave, so a newcomer never overtakes a waiting one. Deadlines use the injected clock;
waiters wake when a replica frees a slot or a health check changes what the replicas report."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class AdmissionQueue:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._order: deque[object] = deque()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._order)

    def notify(self) -> None:
        """Something changed (a slot freed, loads re-read): every waiter looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_turn(self, has_room: Callable[[], bool], timeout: float) -> bool:
        """Wait until this request is at the head and ``has_room()``; False on timeout. On True
        the caller must take its slot before it next awaits (nothing else runs in between)."""
        ticket = object()
        self._order.append(ticket)
        deadline = self.clock() + timeout
        try:
            while not (self._order[0] is ticket and has_room()):
                left = deadline - self.clock()
                if left <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    return False
            return True
        finally:
            self._order.remove(ticket)
            self.notify()  # the next in line may go now
