"""The cluster file: one YAML in the shape operators write for vLLM on Ray, read and checked
whole (an unknown key is an error that names it), and the plan it resolves to.

    deployment_config: {model: PATH, served_model_name: NAME, replica_host: 127.0.0.1,
                        api_key: KEY, max_num_queued_requests: N, request_timeout: S, ...}
    engine_args: {tensor_parallel_size: 1, max_num_seqs: 64, ...}   # pagellm's engine settings
    ray_config: {address: auto, num_replicas: 2, min_replicas: 1, max_replicas: 4,
                 resources_per_replica: {CPU: 1}, max_restarts: 3, ...}
    gateway: {host: 127.0.0.1, port: 8080, routing: least-load, keys: [...], overload: {...}}

No torch and no ray here: ``pagellm cluster up --dry-run`` works anywhere. A replica reachable
from other machines (a replica_host that is not loopback) must require a key (api_key): else
anyone who can reach it bypasses the gateway's keys and limits.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagellm.config import (
    DEVICES,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    EngineConfig,
    flat_fields,
)

# vLLM engine arguments pagellm accepts only at the values that mean "nothing special".
_VLLM_ONLY = {
    "trust_remote_code": (False, None),
}


SERVER_LIMITS = ("max_num_queued_requests", "max_num_queued_tokens", "request_timeout",
                 "max_body_bytes")  # fmt: skip
"""deployment_config fields that are the replicas' server settings of the same names."""
SERVER_TOOL_SETTINGS = ("enable_auto_tool_choice", "tool_call_parser")
"""deployment_config fields for tool calling: the replicas' --enable-auto-tool-choice and
--tool-call-parser."""


class ClusterConfigError(ValueError):
    """The cluster file cannot be used; the message names the section and key."""


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    model: str | None = None
    """HF directory or .gguf file, the same path on every node; none: the default model."""
    served_model_name: str | None = None
    replica_host: str = "127.0.0.1"
    """Address a replica's server binds and is reached at (its node's address in a real
    multi-machine cluster); one that is not loopback needs api_key."""
    api_key: str | None = None
    """Key the replicas require (the gateway sends it); none: replicas are open, which only a
    loopback replica_host may be."""
    max_num_queued_requests: int | None = None
    """Each replica's server setting of that name (its sequences waiting for a first token; over
    it, 503 with Retry-After); none: the server's default."""
    max_num_queued_tokens: int | None = None
    """Each replica's server setting: prompt tokens waiting; over it, 503. None: unbounded."""
    request_timeout: float | None = None
    """Each replica's server setting: seconds after which a request is aborted (504)."""
    max_body_bytes: int | None = None
    """Each replica's server setting: largest request body (413); none: the server's default."""
    enable_auto_tool_choice: bool = False
    """Each replica parses the model's tool calls for tool_choice "auto" (needs
    tool_call_parser), as vLLM's --enable-auto-tool-choice."""
    tool_call_parser: str | None = None
    """The model's tool-call format: hermes or llama3_json."""


@dataclass(frozen=True, slots=True)
class RayConfig:
    address: str | None = None
    """Ray cluster to join ('auto': the one this machine belongs to); none: start one here."""
    node_ip_address: str | None = None
    """This machine's address in the Ray cluster (127.0.0.1 for one on loopback); none: Ray
    finds it (and a Ray started here binds 127.0.0.1)."""
    namespace: str = "pagellm"
    name: str = "pagellm"
    """Name of the detached controller actor (one cluster per name)."""
    num_replicas: int = 1
    min_replicas: int | None = None
    """Fewest replicas the autoscaler keeps (default: num_replicas)."""
    max_replicas: int | None = None
    """Most replicas the autoscaler adds (default: num_replicas)."""
    resources_per_replica: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources one replica reserves (CPU, GPU, or custom ones), split over its ranks."""
    placement_strategy: str = "STRICT_PACK"
    """How a replica's rank bundles are placed: STRICT_PACK keeps its ranks on one node, PACK
    or SPREAD may put them on several (the ranks are Ray actors talking gloo over the nodes'
    addresses)."""
    max_restarts: int = 3
    """Times Ray restarts a replica's actor that died."""
    controller_max_restarts: int = -1
    """Times Ray restarts the controller (and the gateway in it) after its process dies; -1:
    always. A restarted controller starts the gateway and num_replicas replicas afresh: Ray
    ends the replicas and placement groups the dead one owned."""
    health_interval: float = 2.0
    """Seconds between the controller's looks at the replicas (and the autoscaler's)."""
    upscale_queue_depth: float = 4.0
    """Waiting requests per replica above which one more replica is started..."""
    upscale_delay: float = 5.0
    """... once it has lasted this many seconds."""
    downscale_delay: float = 30.0
    """Seconds without any request before a replica above min_replicas is stopped."""
    start_timeout: float = 300.0
    """Seconds a replica may take to load and answer before it counts as failed."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    routing: str = "least-load"
    max_attempts: int = 2
    health_interval: float = 2.0
    breaker_failures: int = 3
    breaker_reset: float = 5.0
    max_body_bytes: int = 4 << 20
    upstream_timeout: float = 600.0
    keys: list[dict[str, Any]] = field(default_factory=list)
    """As the gateway's config file gives them (checked the same way)."""
    overload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    deployment: DeploymentConfig
    engine_args: dict[str, Any]
    ray: RayConfig
    gateway: GatewayConfig
    notes: tuple[str, ...] = ()
    """What the plan accepted but does not use (vLLM-only arguments)."""

    @property
    def world_size(self) -> int:
        args = self.engine_args
        return int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))

    @property
    def min_replicas(self) -> int:
        return self.ray.min_replicas if self.ray.min_replicas is not None else self.ray.num_replicas

    @property
    def max_replicas(self) -> int:
        return self.ray.max_replicas if self.ray.max_replicas is not None else self.ray.num_replicas

    def bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per rank; the replica's resources split evenly."""
        n = self.world_size
        return [{k: v / n for k, v in self.ray.resources_per_replica.items()} for _ in range(n)]

    def plan(self) -> dict[str, Any]:
        """What ``cluster up`` will do, as plain data (``--dry-run`` prints it)."""
        return {
            "ray": {"address": self.ray.address or "(start a local Ray)",
                    "namespace": self.ray.namespace, "controller": self.ray.name},
            "model": self.deployment.model or "(default SmolLM2-135M-Instruct)",
            "served_model_name": self.deployment.served_model_name,
            "replica_server": {"host": self.deployment.replica_host,
                               "api_key": "(set)" if self.deployment.api_key else None,
                               **{name: getattr(self.deployment, name)
                                  for name in SERVER_LIMITS + SERVER_TOOL_SETTINGS}},
            "replicas": {"initial": self.ray.num_replicas, "min": self.min_replicas,
                         "max": self.max_replicas, "max_restarts": self.ray.max_restarts,
                         "controller_max_restarts": self.ray.controller_max_restarts},
            "per_replica": {"ranks": self.world_size, "resources": self.ray.resources_per_replica,
                            "placement_group": {"strategy": self.ray.placement_strategy,
                                                "bundles": self.bundles()}},
            "engine_args": dataclasses.asdict(EngineConfig.from_flat(**self.engine_args)),
            "autoscaling": {"upscale_queue_depth": self.ray.upscale_queue_depth,
                            "upscale_delay_s": self.ray.upscale_delay,
                            "downscale_delay_s": self.ray.downscale_delay},
            "gateway": {"url": f"http://{self.gateway.host}:{self.gateway.port}",
                        "routing": self.gateway.routing, "keys": len(self.gateway.keys),
                        "overload": self.gateway.overload},
            "notes": list(self.notes),
        }  # fmt: skip


def load_cluster_config(path: str | Path) -> ClusterConfig:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ClusterConfigError(f"{path}: {exc}") from exc
    return parse_cluster_config(data, str(path))


def parse_cluster_config(data: Any, where: str = "cluster config") -> ClusterConfig:
    if not isinstance(data, dict):
        raise ClusterConfigError(f"{where}: expected a mapping at the top")
    sections = {"deployment_config", "engine_args", "ray_config", "gateway"}
    unknown = sorted(set(data) - sections)
    if unknown:
        raise ClusterConfigError(f"{where}: unknown section {unknown[0]!r}")
    engine_args, notes = _engine_args(data.get("engine_args") or {}, where)
    ranks = int(engine_args.get("tensor_parallel_size", 1)) * int(
        engine_args.get("pipeline_parallel_size", 1)
    )
    if ranks > 1:  # a replica's ranks are Ray actors on its placement group, as in vLLM on Ray
        engine_args.setdefault("distributed_executor_backend", "ray")
    deployment = _section(
        DeploymentConfig, data.get("deployment_config"), where, "deployment_config"
    )
    if deployment.model and not Path(deployment.model).expanduser().exists():
        notes.append(  # the path is each node's: this machine may not be one of them
            f"deployment_config.model {deployment.model!r} does not exist on this machine; "
            "every node needs it at that path"
        )
    config = ClusterConfig(
        deployment=deployment,
        engine_args=engine_args,
        ray=_section(RayConfig, data.get("ray_config"), where, "ray_config"),
        gateway=_section(GatewayConfig, data.get("gateway"), where, "gateway"),
        notes=tuple(notes),
    )
    _check(config, where)
    return config


def _section(cls: type, values: Any, where: str, name: str) -> Any:
    values = values or {}
    if not isinstance(values, dict):
        raise ClusterConfigError(f"{where}: {name} must be a mapping")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in known:
            raise ClusterConfigError(f"{where}: {name}: unknown key {key!r}")
        _check_type(value, known[key], f"{where}: {name}.{key}")
    return cls(**values)


def _check_type(value: Any, f: dataclasses.Field, where: str) -> None:
    if value is None:
        return
    kind = str(f.type)
    expected: tuple[type, ...]
    if kind.startswith("int"):
        expected = (int,)
    elif kind.startswith("float"):
        expected = (int, float)
    elif kind.startswith("str"):
        expected = (str,)
    elif kind.startswith("dict"):
        expected = (dict,)
    elif kind.startswith("list"):
        expected = (list,)
    else:
        return
    if isinstance(value, bool) or not isinstance(value, expected):
        raise ClusterConfigError(f"{where}: expected {kind}, got {value!r}")


def _engine_args(values: Any, where: str) -> tuple[dict[str, Any], list[str]]:
    if not isinstance(values, dict):
        raise ClusterConfigError(f"{where}: engine_args must be a mapping")
    fields_by_name = dict(flat_fields())
    args, notes = {}, []
    for key, value in values.items():
        if key in ("model", "served_model_name"):
            raise ClusterConfigError(f"{where}: engine_args.{key}: give it in deployment_config")
        if key in _VLLM_ONLY:
            allowed = _VLLM_ONLY[key]
            if allowed is not None and value not in allowed:
                raise ClusterConfigError(
                    f"{where}: engine_args.{key}={value!r} is not supported by pagellm"
                )
            notes.append(f"engine_args.{key}={value!r} accepted and not used")
            continue
        if key not in fields_by_name:
            raise ClusterConfigError(f"{where}: engine_args: unknown key {key!r}")
        if key in _JSON_OBJECT_FLAGS and isinstance(value, dict):
            value = json.dumps(value)  # vLLM's YAML gives the mapping; the flag takes JSON
        _check_type(value, fields_by_name[key], f"{where}: engine_args.{key}")
        for name, known in (("quantization", QUANTIZATION_METHODS),
                            ("kv_cache_dtype", KV_CACHE_DTYPES)):  # fmt: skip
            if key == name and value is not None and value not in known:
                raise ClusterConfigError(
                    f"{where}: engine_args.{key}={value!r} is not supported by pagellm "
                    f"(one of {', '.join(known)})"
                )
        args[key] = value
    _check_speculative(args, where)
    _check_compilation(args, where)
    _check_structured(args, where)
    return args, notes


_JSON_OBJECT_FLAGS = ("speculative_config", "compilation_config", "structured_outputs_config")


def _check_structured(args: dict[str, Any], where: str) -> None:
    from pagellm.config import StructuredOutputsConfig, structured_settings

    try:
        structured_settings(StructuredOutputsConfig(args.get("structured_outputs_config")))
    except ValueError as exc:
        raise ClusterConfigError(f"{where}: engine_args: {exc}") from exc


def _check_compilation(args: dict[str, Any], where: str) -> None:
    from pagellm.config import CompilationConfig
    from pagellm.runner.capture_settings import max_capture_size

    names = {f.name for f in dataclasses.fields(CompilationConfig)}
    given = {k: v for k, v in args.items() if k in names}
    try:
        max_capture_size(CompilationConfig(**given), 1)
    except ValueError as exc:
        raise ClusterConfigError(f"{where}: engine_args: {exc}") from exc


def _check_speculative(args: dict[str, Any], where: str) -> None:
    from pagellm.config import SpeculativeConfig
    from pagellm.spec.settings import spec_settings

    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    given = {k: v for k, v in args.items() if k in names}
    try:
        spec_settings(SpeculativeConfig(**given))
    except ValueError as exc:
        raise ClusterConfigError(f"{where}: engine_args: {exc}") from exc


def _check(config: ClusterConfig, where: str) -> None:
    _check_ranges(config, where)
    r = config.ray
    if not 1 <= config.min_replicas <= r.num_replicas <= config.max_replicas:
        raise ClusterConfigError(
            f"{where}: ray_config: need 1 <= min_replicas <= num_replicas <= max_replicas"
        )
    if r.placement_strategy not in ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"):
        raise ClusterConfigError(
            f"{where}: ray_config.placement_strategy {r.placement_strategy!r} is not a Ray strategy"
        )
    if config.engine_args.get("device", "auto") not in DEVICES:
        raise ClusterConfigError(f"{where}: engine_args.device must be one of {DEVICES}")
    gpus = r.resources_per_replica.get("GPU", 0)
    if gpus and gpus != config.world_size:
        raise ClusterConfigError(
            f"{where}: ray_config.resources_per_replica.GPU={gpus:g} must equal the replica's "
            f"ranks ({config.world_size} = tensor_parallel_size x pipeline_parallel_size): "
            "one GPU per rank"
        )
    from pagellm.gateway.routing import ROUTING_POLICIES

    if config.gateway.routing not in ROUTING_POLICIES:
        raise ClusterConfigError(f"{where}: gateway.routing must be one of {ROUTING_POLICIES}")
    _check_deployment(config.deployment, where)
    _check_gateway(config.gateway, where)


def _check_ranges(config: ClusterConfig, where: str) -> None:
    """Values of the right type but out of range, refused here rather than inside Ray."""
    try:
        EngineConfig.from_flat(**config.engine_args)
    except (TypeError, ValueError) as exc:
        raise ClusterConfigError(f"{where}: engine_args: {exc}") from exc
    for name, amount in config.ray.resources_per_replica.items():
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
            raise ClusterConfigError(
                f"{where}: ray_config.resources_per_replica.{name} must be a number >= 0"
            )
    r, g = config.ray, config.gateway
    rules = [
        ("ray_config.health_interval", r.health_interval, 0, False),
        ("ray_config.upscale_queue_depth", r.upscale_queue_depth, 0, False),
        ("ray_config.upscale_delay", r.upscale_delay, 0, True),
        ("ray_config.downscale_delay", r.downscale_delay, 0, True),
        ("ray_config.start_timeout", r.start_timeout, 0, False),
        ("ray_config.max_restarts", r.max_restarts, -1, True),
        ("ray_config.controller_max_restarts", r.controller_max_restarts, -1, True),
        ("gateway.max_attempts", g.max_attempts, 0, False),
        ("gateway.health_interval", g.health_interval, 0, False),
        ("gateway.breaker_failures", g.breaker_failures, 0, False),
        ("gateway.breaker_reset", g.breaker_reset, 0, True),
        ("gateway.max_body_bytes", g.max_body_bytes, 0, False),
        ("gateway.upstream_timeout", g.upstream_timeout, 0, False),
    ]
    for name, value, bound, inclusive in rules:
        if value < bound or (value == bound and not inclusive):
            sign = ">=" if inclusive else ">"
            raise ClusterConfigError(f"{where}: {name} must be {sign} {bound}, got {value}")
    if not 0 <= g.port <= 65535:
        raise ClusterConfigError(f"{where}: gateway.port {g.port} is not a port (0-65535)")


def _check_deployment(d: DeploymentConfig, where: str) -> None:
    if not d.api_key and not _is_loopback(d.replica_host):
        raise ClusterConfigError(
            f"{where}: deployment_config.replica_host {d.replica_host!r} can be reached from "
            "other machines, which would bypass the gateway's keys and limits: set "
            "deployment_config.api_key (the replicas then require it; the gateway sends it)"
        )
    for name in SERVER_LIMITS:
        value = getattr(d, name)
        if value is not None and value <= 0:
            raise ClusterConfigError(f"{where}: deployment_config.{name} must be above 0")
    from pagellm.structured.tool_parsers import TOOL_CALL_PARSERS

    if d.tool_call_parser is not None and d.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ClusterConfigError(
            f"{where}: deployment_config.tool_call_parser must be one of {TOOL_CALL_PARSERS}"
        )
    if d.enable_auto_tool_choice and d.tool_call_parser is None:
        raise ClusterConfigError(
            f"{where}: deployment_config.enable_auto_tool_choice needs tool_call_parser"
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False


def _check_gateway(g: GatewayConfig, where: str) -> None:
    """The keys and overload rules as the gateway checks its own config file."""
    from pagellm.gateway.config import ConfigError, checked_keys, checked_overload

    try:
        checked_keys(g.keys, f"{where}: gateway")
        checked_overload(g.overload, f"{where}: gateway")
    except ConfigError as exc:
        raise ClusterConfigError(str(exc)) from exc
