"""The cluster's controller, a detached Ray actor: it places the replicas (one placement group and
one actor each, restarted by Ray after a crash up to ``max_restarts``), runs the gateway in its
own process, keeps the gateway's replica list equal to the replicas that answer, and scales the
replicas on queue depth. A replica whose actor is restarting leaves the gateway's list until it
answers again (at its new address); one that stays silent longer than a start may take (Ray gave
up restarting it) is replaced. Ray restarts the controller itself when its process dies
(``controller_max_restarts``); the replicas and placement groups it owned end with it, and the
new controller starts the gateway and the replicas afresh, on its own.

Every wait is bounded: a replica that cannot be placed within ``start_timeout`` (no node has
room) is given up (its placement group removed, an event recorded), and scaling runs beside the
replicas' health looks, never in their way. The supervision loop survives what it did not expect:
the error is logged and recorded as an event, and the next round goes on.

Like ReplicaServer, the class is plain; ``ray.remote`` is applied by ``pagellm.cluster.api``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagellm.cluster.autoscale import Autoscaler, Load
from pagellm.cluster.config import ClusterConfig, parse_cluster_config

MAX_EVENTS = 1000
"""Events kept (a persistent fault records one per supervision round)."""
LOOK_TIMEOUT = 5.0
"""Seconds a replica may take to answer the controller's look before it counts as down."""
RESUME_RETRIES = 10
"""Times Ray sends a restarted controller's call to itself again when it is refused."""
GATEWAY_START_TIMEOUT = 30.0
"""Seconds the gateway's server may take to start listening (or to stop)."""
log = logging.getLogger("pagellm.cluster")


@dataclass
class _Slot:
    """One replica: its actor, its placement group, and what the last look found."""

    name: str
    actor: Any
    group: Any
    url: str | None = None
    node: str | None = None
    load: dict[str, float] = field(default_factory=dict)
    restarts: int = 0
    urls_seen: list[str] = field(default_factory=list)
    started: float = 0.0
    down_since: float | None = None


class ClusterController:
    def __init__(self, config: dict[str, Any]) -> None:
        self.raw_config = config
        self.config: ClusterConfig = parse_cluster_config(config)
        r = self.config.ray
        self.autoscaler = Autoscaler(
            self.config.min_replicas, self.config.max_replicas, r.upscale_queue_depth,
            r.upscale_delay, r.downscale_delay, time.monotonic,
        )  # fmt: skip
        self.slots: list[_Slot] = []
        self.events: deque[str] = deque(maxlen=MAX_EVENTS)
        self._names = itertools.count()
        self._scaling: asyncio.Task | None = None
        self._gateway: Any = None
        self._server: Any = None
        self._serving: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self.restarted = _was_restarted()
        if self.restarted:
            import ray

            self.events.append("controller: restarted by Ray; starting the gateway and replicas")
            # sent while Ray still has this actor restarting, the call may be refused: Ray then
            # sends it again once the actor is alive (a refused call with no retry left would
            # leave the restarted controller without its gateway and replicas)
            resume = ray.get_runtime_context().current_actor.resume
            resume.options(max_task_retries=RESUME_RETRIES).remote()

    # ----- lifecycle ------------------------------------------------------------------------

    async def start(self) -> str:
        """Start the gateway and the initial replicas; returns the gateway's URL."""
        if self._gateway is not None:
            raise RuntimeError("the controller is started already")
        await self._start_gateway()
        await asyncio.gather(*(self._add_replica() for _ in range(self.config.ray.num_replicas)))
        self._tasks.append(asyncio.create_task(self._supervise()))
        g = self.config.gateway
        return f"http://{g.host}:{g.port}"

    async def resume(self) -> None:
        """Start after Ray restarted this controller; nothing if it is started already."""
        if self._gateway is None:
            await self.start()

    async def shutdown(self) -> None:
        for task in [*self._tasks, *([self._scaling] if self._scaling else [])]:
            if task is not self._serving:
                task.cancel()
        for slot in list(self.slots):
            await self._remove(slot, "shutdown")
        if self._serving is not None:
            self._server.should_exit = True  # it stops serving, then its task ends
            await asyncio.wait([self._serving], timeout=GATEWAY_START_TIMEOUT)

    async def status(self) -> dict[str, Any]:
        g = self.config.gateway
        return {
            "gateway": f"http://{g.host}:{g.port}",
            "controller": {"pid": os.getpid(), "restarted": self.restarted},
            "replicas": [
                {"name": s.name, "url": s.url, "node": s.node, "state": "up" if s.url else "down",
                 "restarts": s.restarts, "load": s.load}
                for s in self.slots
            ],
            "min_replicas": self.config.min_replicas,
            "max_replicas": self.config.max_replicas,
            "events": list(self.events)[-30:],
        }  # fmt: skip

    # ----- the gateway --------------------------------------------------------------------

    async def _start_gateway(self) -> None:
        import uvicorn

        from pagellm.gateway.app import Gateway, build_gateway_app
        from pagellm.gateway.config import GatewaySettings

        g = self.config.gateway
        settings = GatewaySettings(
            fleet=self._fleet([]), routing=g.routing, max_attempts=g.max_attempts,
            health_interval=g.health_interval, breaker_failures=g.breaker_failures,
            breaker_reset=g.breaker_reset, upstream_timeout=g.upstream_timeout,
            max_body_bytes=g.max_body_bytes, backend_api_key=self.config.deployment.api_key,
        )  # fmt: skip
        self._gateway = Gateway(settings)
        config = uvicorn.Config(build_gateway_app(self._gateway), host=g.host, port=g.port,
                                log_level="warning")  # fmt: skip
        self._server = uvicorn.Server(config)
        self._serving = asyncio.create_task(self._server.serve())
        self._tasks.append(self._serving)
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT
        while not self._server.started:
            if self._serving.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway could not start on {g.host}:{g.port}")
            await asyncio.sleep(0.05)

    def _fleet(self, urls: list[str]) -> Any:
        from pagellm.gateway.config import Fleet, OverloadSettings

        g = self.config.gateway
        return Fleet(backends=tuple(urls), keys=tuple(g.keys),
                     overload=OverloadSettings(**g.overload))  # fmt: skip

    async def _sync_gateway(self) -> None:
        urls = [s.url for s in self.slots if s.url]
        if tuple(urls) != self._gateway.fleet.backends:
            await self._gateway.apply(self._fleet(urls))

    # ----- replicas -----------------------------------------------------------------------

    async def _add_replica(self) -> bool:
        """Place and start one replica; False when it could not be placed in time."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from pagellm.cluster.replica import ReplicaServer

        cfg = self.config
        bundles = cfg.bundles()
        group = placement_group(bundles, strategy=cfg.ray.placement_strategy)
        try:
            await asyncio.wait_for(group.ready(), cfg.ray.start_timeout)
        except TimeoutError:
            remove_placement_group(group)
            self.events.append(
                f"a replica could not be placed within {cfg.ray.start_timeout:g} s "
                f"(bundles {bundles}, {cfg.ray.placement_strategy}): no room; given up"
            )
            return False
        first = dict(bundles[0])
        actor = (
            ray.remote(ReplicaServer)
            .options(
                num_cpus=first.pop("CPU", 0), num_gpus=first.pop("GPU", 0), resources=first,
                max_restarts=cfg.ray.max_restarts, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
            )
            .remote(_deployment(cfg), cfg.engine_args)
        )  # fmt: skip
        slot = _Slot(f"replica-{next(self._names)}", actor, group, started=time.monotonic())
        self.slots.append(slot)
        self.events.append(f"{slot.name}: placed")
        await self._look(slot, cfg.ray.start_timeout)
        await self._sync_gateway()
        return True

    async def _look(self, slot: _Slot, timeout: float = LOOK_TIMEOUT) -> None:
        """Ask one replica where it is and how loaded; no answer takes it out of rotation, and
        no answer for longer than a start takes (Ray gave up restarting it) replaces it."""
        from ray.exceptions import RayError

        try:
            load = await asyncio.wait_for(slot.actor.load.remote(), timeout)
        except (TimeoutError, RayError) as exc:
            if slot.url is not None:
                self.events.append(f"{slot.name}: down ({type(exc).__name__})")
                slot.down_since = time.monotonic()
            slot.url = None
            down_for = time.monotonic() - (slot.down_since or slot.started)
            if down_for > self.config.ray.start_timeout:
                await self._replace(slot)
            return
        url, node = load.pop("url"), load.pop("node")
        if url != slot.url:
            if slot.urls_seen and url not in slot.urls_seen:
                slot.restarts += 1
                self.events.append(f"{slot.name}: restarted by Ray, now at {url}")
            elif not slot.urls_seen:
                self.events.append(f"{slot.name}: up at {url} on node {node[:8]}")
            slot.urls_seen.append(url)
        slot.node, slot.load, slot.down_since = node, load, None
        if load.get("healthy"):
            slot.url = url
            return
        # it answers but cannot serve (its engine stopped: a rank died): out of rotation, and
        # a restart of its actor (Ray's) builds it afresh, ranks included
        slot.url = None
        self.events.append(f"{slot.name}: unhealthy; restarting it")
        import ray

        ray.kill(slot.actor, no_restart=False)

    async def _replace(self, slot: _Slot) -> None:
        """Remove a replica gone for good; scaling (beside the looks) places a new one if that
        leaves fewer than min_replicas."""
        self.events.append(f"{slot.name}: no answer since a start's time; replacing it")
        await self._remove(slot, "dead")

    async def _remove(self, slot: _Slot, why: str) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if slot in self.slots:
            self.slots.remove(slot)
        await self._sync_gateway()  # no new requests reach it
        if why != "dead":
            with contextlib.suppress(Exception):  # a replica already gone has nothing to stop
                await asyncio.wait_for(slot.actor.stop.remote(), LOOK_TIMEOUT)
        ray.kill(slot.actor, no_restart=True)
        remove_placement_group(slot.group)
        self.events.append(f"{slot.name}: removed ({why})")

    # ----- supervision and scaling ----------------------------------------------------------

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.config.ray.health_interval)
            await self._guarded("supervise", self._supervise_once)

    async def _supervise_once(self) -> None:
        await asyncio.gather(*(self._look(s) for s in list(self.slots)))
        await self._sync_gateway()
        if self._scaling is None or self._scaling.done():  # one scaling step at a time
            self._scaling = asyncio.create_task(self._guarded("scale", self._scale))

    async def _guarded(self, what: str, step: Any) -> None:
        """Run one step; an error it did not expect is logged and recorded as an event."""
        try:
            await step()
        except Exception as exc:
            log.exception("cluster controller: %s failed", what)
            self.events.append(f"{what}: unexpected {type(exc).__name__}: {exc}")

    async def _scale(self) -> None:
        up = [s for s in self.slots if s.url]
        waiting = sum(s.load.get("waiting", 0.0) for s in up) + len(self._gateway.queue)
        running = sum(s.load.get("running", 0.0) for s in up)
        outstanding = sum(r.outstanding for r in self._gateway.replicas)
        load = Load(len(self.slots), waiting, max(running, float(outstanding)))
        want = self.autoscaler.desired(load)
        if want > len(self.slots):
            self.events.append(f"scale up: {waiting:.0f} waiting on {len(self.slots)}")
            await self._add_replica()
        elif want < len(self.slots):
            self.events.append("scale down: idle")
            await self._remove(self.slots[-1], "scaled down")


def _was_restarted() -> bool:
    """Whether Ray restarted this actor (its API for it warns about an internal rename)."""
    import ray

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ray.get_runtime_context().was_current_actor_reconstructed


def _deployment(cfg: ClusterConfig) -> dict[str, Any]:
    """What a replica is built from: the deployment config (model, address, key, the server's
    queue limits and timeouts) as plain data."""
    return dataclasses.asdict(cfg.deployment)
