"""``pagellm cluster up|status|down`` from Python: connect to Ray (or start it here), and drive
the detached controller actor named in the config.

    from pagellm.cluster import api
    url = api.up("cluster.yaml")      # the gateway's URL
    api.status("cluster.yaml")        # replicas, their nodes, restarts, recent events
    api.down("cluster.yaml")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pagellm.cluster.config import ClusterConfig, load_cluster_config, parse_cluster_config

_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray keeps every address on loopback (its switch for single-machine clusters)."""


class ClusterError(RuntimeError):
    pass


def _read(config: str | Path | dict[str, Any]) -> tuple[dict[str, Any], ClusterConfig]:
    if isinstance(config, dict):
        return config, parse_cluster_config(config)
    import yaml

    parsed = load_cluster_config(config)  # raises naming what is wrong
    return yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}, parsed


def connect(cfg: ClusterConfig) -> None:
    """Join the configured Ray cluster (or start one in this process, on loopback), in the
    config's namespace; a no-op when this process is already connected."""
    if cfg.ray.address is None:
        # Ray resolves 127.0.0.1 to the machine's outward address unless told this is a
        # single-machine cluster; a Ray started here stays on loopback.
        os.environ.setdefault(_SINGLE_MACHINE, "0")
    import ray

    if ray.is_initialized():
        return
    ip = cfg.ray.node_ip_address or ("127.0.0.1" if cfg.ray.address is None else None)
    local = {"_node_ip_address": ip} if ip else {}
    ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, include_dashboard=False,
             logging_level="warning", log_to_driver=False, **local)  # fmt: skip


def _controller(cfg: ClusterConfig) -> Any:
    import ray

    try:
        return ray.get_actor(cfg.ray.name, namespace=cfg.ray.namespace)
    except ValueError:
        return None


def up(config: str | Path | dict[str, Any]) -> str:
    """Start the controller, the gateway and the replicas; returns the gateway's URL once the
    initial replicas answer."""
    import ray

    from pagellm.cluster.controller import ClusterController

    raw, cfg = _read(config)
    connect(cfg)
    if _controller(cfg) is not None:
        raise ClusterError(f"a cluster named {cfg.ray.name!r} is already up; `down` it first")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # the gateway binds an address of this node: a restarted controller comes back here
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    controller = (
        ray.remote(ClusterController)
        .options(
            name=cfg.ray.name,
            namespace=cfg.ray.namespace,
            lifetime="detached",
            num_cpus=0,
            max_restarts=cfg.ray.controller_max_restarts,
            scheduling_strategy=here,
        )
        .remote(raw)
    )
    try:
        return ray.get(controller.start.remote())
    except Exception:
        _stop(controller)
        raise


def status(config: str | Path | dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    """The controller's report; ray's GetTimeoutError when it takes over ``timeout`` seconds
    to answer (it may be restarting)."""
    import ray

    _, cfg = _read(config)
    connect(cfg)
    controller = _controller(cfg)
    if controller is None:
        raise ClusterError(f"no cluster named {cfg.ray.name!r} is up")
    return ray.get(controller.status.remote(), timeout=timeout)


def down(config: str | Path | dict[str, Any]) -> None:
    _, cfg = _read(config)
    connect(cfg)
    controller = _controller(cfg)
    if controller is None:
        raise ClusterError(f"no cluster named {cfg.ray.name!r} is up")
    _stop(controller)


def _stop(controller: Any) -> None:
    import ray

    try:
        ray.get(controller.shutdown.remote(), timeout=120)
    finally:
        ray.kill(controller, no_restart=True)
