"""Scheduling policies: who is admitted first, and who is preempted when blocks run out.

A policy ranks requests: lower ranks are served first and preempted last. The scheduler admits
waiting requests in rank order, runs running requests in rank order, and picks the running
request with the highest rank as the preemption victim.

- ``fcfs``: arrival order; ``priority`` is ignored.
- ``priority``: ``(priority, arrival)``; a lower value is more important. A waiting request that
  cannot be admitted may preempt running requests of a strictly less important priority.
- ``fair``: per-tenant virtual token counting (after Sheng et al., "Fairness in Serving Large
  Language Models", OSDI 2024). Every computed token is charged to its request's tenant; the
  tenant with the smallest counter goes first, and the preemption victim belongs to the tenant
  with the largest. A tenant that becomes active starts at the smallest counter among active
  tenants, so idle time is not banked as credit (and an idle tenant's counter is dropped). Fairness reorders the queue and never
  preempts, so a tenant flooding the server delays another tenant's next request by at most the
  time until one running request finishes, however long the flood's queue.

On top of every policy, a thrash guard: a request preempted ``protect_after`` times or more is
chosen as a victim only when no unprotected request is left, so long prompts do not ping-pong.
"""

from __future__ import annotations

from pagellm.engine.request import Request

POLICIES = ("fcfs", "priority", "fair")


class SchedulingPolicy:
    """Base: arrival order."""

    name = "fcfs"
    preempts_for_arrivals = False
    """Whether a waiting request may ever preempt running ones (see ``may_preempt_for``)."""

    def __init__(self, protect_after: int = 2) -> None:
        self.protect_after = protect_after

    def rank(self, req: Request) -> tuple:
        return (req.arrival_seq,)

    def may_preempt_for(self, arrival: Request, victim: Request) -> bool:
        """Whether a waiting ``arrival`` that does not fit may preempt a running ``victim``."""
        return False

    def charge(self, req: Request, num_tokens: int) -> None:
        """``num_tokens`` were computed for ``req`` this step."""

    def on_waiting(self, req: Request) -> None:
        """A new ``req`` arrived (called once per request, in O(1) or O(tenants))."""

    def on_finished(self, req: Request) -> None:
        """``req`` finished (called once per request, in O(1))."""

    def is_protected(self, req: Request) -> bool:
        return req.num_preemptions >= self.protect_after

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt: unprotected ones first, then by rank."""
        return max(running, key=lambda r: (not self.is_protected(r), self.rank(r)))


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    preempts_for_arrivals = True

    def rank(self, req: Request) -> tuple:
        return (req.priority, req.arrival_seq)

    def may_preempt_for(self, arrival: Request, victim: Request) -> bool:
        return victim.priority > arrival.priority and not self.is_protected(victim)


class FairPolicy(SchedulingPolicy):
    name = "fair"

    def __init__(self, protect_after: int = 2) -> None:
        super().__init__(protect_after)
        self.counters: dict[str, float] = {}
        """Active tenant -> virtual tokens served."""
        self.active: dict[str, int] = {}
        """Active tenant -> its unfinished requests (kept in step, so no event rescans)."""

    def rank(self, req: Request) -> tuple:
        return (self.counters.get(req.tenant, 0.0), req.arrival_seq)

    def charge(self, req: Request, num_tokens: int) -> None:
        self.counters[req.tenant] = self.counters.get(req.tenant, 0.0) + num_tokens

    def on_waiting(self, req: Request) -> None:
        self.active[req.tenant] = self.active.get(req.tenant, 0) + 1
        if req.tenant not in self.counters:  # newly active: level with the least served
            self.counters[req.tenant] = min(self.counters.values(), default=0.0)

    def on_finished(self, req: Request) -> None:
        left = self.active.get(req.tenant, 0) - 1
        if left > 0:
            self.active[req.tenant] = left
            return
        # idle: forgotten (memory stays bounded by the active tenants); if it comes back it
        # starts level with the least-served active tenant, neither behind nor ahead
        self.active.pop(req.tenant, None)
        self.counters.pop(req.tenant, None)


_REGISTRY: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "fair": FairPolicy,
}


def make_policy(name: str, protect_after: int = 2) -> SchedulingPolicy:
    try:
        return _REGISTRY[name](protect_after)
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {POLICIES}") from None
