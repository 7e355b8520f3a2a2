"""The gateway's settings: the fixed ones (from flags) and the fleet (replicas, fallback replicas,
API keys, overload rules) that a YAML file gives and that reloads without a restart. A file is
checked whole before it is used: an unknown key, a wrong type or a value out of range is an error
that names it, and a reload that fails keeps the fleet that was running."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pagellm.gateway.limits import hash_key

_KEY_FIELDS: dict[str, type | tuple[type, ...]] = {
    "name": str,
    "key_sha256": str,
    "key": str,
    "models": list,
    "requests_per_minute": (int, float),
    "tokens_per_minute": (int, float),
    "max_concurrent": int,
    "priority": int,
    "tenant": str,
    "allow_client_priority": bool,
    "allow_client_user": bool,
    "max_tokens_default": int,
    "operator": bool,
}
_POSITIVE_KEY_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent",
                        "max_tokens_default")  # fmt: skip


class ConfigError(ValueError):
    """A gateway config file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class OverloadSettings:
    """What the gateway does when the replicas are saturated, in this order: cap ``max_tokens``
    of new requests, send them to the fallback replicas, hold them in a bounded queue, 503."""

    max_load: float | None = None
    """Load (requests in flight, or running + waiting as the replica reports) at which a replica
    takes no new request; none: replicas are never considered saturated."""
    cap_at: float | None = None
    """When every primary replica is at this load or more, new requests get ``max_tokens``
    capped to ``max_tokens_cap``; none: never capped."""
    max_tokens_cap: int = 256
    queue_size: int = 0
    """Requests held at the gateway while every replica is saturated; beyond it, 503."""
    queue_timeout: float = 30.0
    """Seconds a request may wait in that queue before it is answered 503."""


@dataclass(frozen=True, slots=True)
class Fleet:
    """The part of the settings that reloads: replicas, fallbacks, keys and overload rules."""

    backends: tuple[str, ...]
    fallbacks: tuple[str, ...] = ()
    """Replicas used only when every primary replica is saturated (e.g. a quantized one)."""
    keys: tuple[dict[str, Any], ...] = ()
    """API keys (name, key_sha256 or key, models, requests_per_minute, tokens_per_minute,
    max_concurrent, priority, tenant, allow_client_priority, allow_client_user,
    max_tokens_default, operator: see ``pagellm.gateway.limits.KeyPolicy``); none means no
    auth at the gateway (and the client's priority and user pass through)."""
    overload: OverloadSettings = field(default_factory=OverloadSettings)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    fleet: Fleet
    routing: str = "least-load"
    max_attempts: int = 2
    """Replicas tried for one request when they fail before the first byte."""
    health_interval: float = 2.0
    breaker_failures: int = 3
    breaker_reset: float = 5.0
    upstream_timeout: float = 600.0
    """Seconds to wait on a replica (its answer's headers, or each read after); past it, 504
    (the request is not sent to another replica: this one may be working on it)."""
    max_body_bytes: int = 4 << 20
    """Largest request body read (counted as it arrives); over it, 413."""
    client_body_timeout: float = 60.0
    """Seconds a request body may take to arrive whole; past them, 408."""
    metrics_need_key: bool = True
    """With keys configured, /metrics needs one (``--allow-unauthenticated-metrics``: not)."""
    backend_api_key: str | None = None
    """Sent to the replicas (health checks, model lists, and proxied requests in place of the
    client's Authorization); without it the client's header is passed through."""
    config_path: str | None = None
    """The YAML file the fleet came from; watched, and reloaded when it changes."""
    flag_backends: tuple[str, ...] = ()
    """Replicas given with --backend: kept across reloads of the file."""
    disable_ui: bool = False
    """No fleet console at /ui (``--disable-ui``)."""


def read_fleet(path: str | Path | None, flag_backends: tuple[str, ...] = ()) -> Fleet:
    """The fleet from the config file (if any) plus the ``--backend`` replicas."""
    data = _load_yaml(path) if path else {}
    flags = tuple(checked_url(u, "--backend") for u in flag_backends)
    backends = (*_urls(data, "backends", path), *flags)
    fleet = Fleet(
        backends=tuple(dict.fromkeys(backends)),
        fallbacks=_urls(data, "fallbacks", path),
        keys=checked_keys(data.get("keys") or [], path),
        overload=checked_overload(data.get("overload") or {}, path),
    )
    if not fleet.backends:
        raise ConfigError("give at least one replica (--backend URL or 'backends' in the config)")
    return fleet


def _load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top")
    unknown = set(data) - {"backends", "fallbacks", "keys", "overload"}
    if unknown:
        raise ConfigError(f"{path}: unknown settings {sorted(unknown)}")
    return data


def _urls(data: dict[str, Any], name: str, path: Any) -> tuple[str, ...]:
    urls = data.get(name) or []
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise ConfigError(f"{path}: '{name}' must be a list of URLs")
    return tuple(checked_url(u, f"{path}: '{name}'") for u in urls)


def checked_url(url: str, where: str) -> str:
    """A replica's base URL (http or https, with a host), without its trailing slash."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: {url!r} is not an http(s) URL with a host")
    return url.rstrip("/")


def checked_keys(entries: Any, where: Any) -> tuple[dict[str, Any], ...]:
    """The API key entries of a config, each checked (``where`` names the file in errors)."""
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: 'keys' must be a list")
    keys = tuple(_checked_key(entry, i, where) for i, entry in enumerate(entries))
    seen: set[str] = set()
    for i, entry in enumerate(keys):
        digest = str(entry.get("key_sha256") or hash_key(entry["key"])).lower()
        if digest in seen:
            raise ConfigError(f"{where}: keys[{i}] repeats an earlier key")
        seen.add(digest)
    return keys


def _checked_key(entry: Any, index: int, path: Any) -> dict[str, Any]:
    where = f"{path}: keys[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a mapping")
    for name, value in entry.items():
        if name not in _KEY_FIELDS:
            raise ConfigError(f"{where}: unknown setting {name!r}")
        if value is not None and not _is_a(value, _KEY_FIELDS[name]):
            raise ConfigError(f"{where}: {name!r} has the wrong type")
    models = entry.get("models") or []
    if not all(isinstance(m, str) for m in models):
        raise ConfigError(f"{where}: 'models' must be a list of model names")
    for name in _POSITIVE_KEY_FIELDS:
        if entry.get(name) is not None and entry[name] <= 0:
            raise ConfigError(f"{where}: {name!r} must be above 0")
    if not entry.get("key_sha256") and not entry.get("key"):
        raise ConfigError(f"{where}: give key_sha256 (or key)")
    digest = entry.get("key_sha256")
    if digest and not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        raise ConfigError(f"{where}: 'key_sha256' must be 64 hex digits (sha256 of the key)")
    return dict(entry)


def _is_a(value: Any, kind: type | tuple[type, ...]) -> bool:
    """isinstance, except that a bool is no number (YAML's true is not 1)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


def checked_overload(data: Any, path: Any) -> OverloadSettings:
    """The overload rules of a config, checked (``path`` names the file in errors)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: 'overload' must be a mapping")
    known = {f.name: f for f in fields(OverloadSettings)}
    for name, value in data.items():
        if name not in known:
            raise ConfigError(f"{path}: overload: unknown setting {name!r}")
        if value is not None and not _is_a(value, (int, float)):
            raise ConfigError(f"{path}: overload: {name!r} must be a number")
        if value is not None and value < 0:
            raise ConfigError(f"{path}: overload: {name!r} must be 0 or more")
    return OverloadSettings(**data)
