"""One replica as a Ray actor's body: the engine and its OpenAI-compatible server (uvicorn on a
thread) in the actor's process, on a free port of the node's address. Ray supervises the actor
(restarting it after a crash, up to ``max_restarts``); a restarted actor builds a fresh replica,
on a new port, and the controller re-registers it with the gateway.

The class is plain: ``ray.remote`` is applied where the actor is created, so importing this
module needs no Ray."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any


class ReplicaServer:
    def __init__(self, deployment: dict[str, Any], engine_args: dict[str, Any]) -> None:
        import uvicorn

        from pagellm.config import EngineConfig
        from pagellm.engine.async_engine import AsyncLLMEngine
        from pagellm.engine_factory import build_engine
        from pagellm.fetch import DEFAULT_FILE
        from pagellm.server.app import build_app

        model = deployment.get("model")
        engine, tokenizer = build_engine(EngineConfig.from_flat(model=model, **engine_args))
        self.front = AsyncLLMEngine(engine)
        self.front.start()
        name = deployment.get("served_model_name") or model or DEFAULT_FILE.removesuffix(".gguf")
        settings = server_settings(deployment, name, engine.max_model_len)
        host = deployment.get("replica_host", "127.0.0.1")
        port = _free_port(host)
        config = uvicorn.Config(build_app(self.front, tokenizer, settings), host=host, port=port,
                                log_level="warning")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="replica-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the replica's server did not start on {host}:{port}")
            time.sleep(0.05)
        self.url = f"http://{host}:{port}"

    def address(self) -> str:
        return self.url

    def load(self) -> dict[str, Any]:
        """What the controller reads: where the replica is (address, Ray node), requests
        waiting and running, and whether it is healthy."""
        stats = self.front.engine.stats
        return {
            "url": self.url,
            "node": _node_id(),
            "waiting": float(stats.num_waiting),
            "running": float(stats.num_running),
            "healthy": float(self.front.is_healthy),
            "pid": float(os.getpid()),
            "rank_nodes": [r.node for r in getattr(self.front.engine.executor, "reports", [])],
            "rank_pids": self._rank_pids(),
        }

    def _rank_pids(self) -> list[int]:
        ranks = getattr(self.front.engine.executor, "ranks", None)
        try:
            return ranks.pids() if ranks is not None else []
        except Exception:  # noqa: BLE001 - a dead rank has no pid; health says the rest
            return []

    def stop(self) -> None:
        """Stop serving (in-flight requests are cut) and stop the engine."""
        self.server.should_exit = True
        self.thread.join(10)
        self.front.shutdown()


def server_settings(deployment: dict[str, Any], model_name: str, max_model_len: int) -> Any:
    """The replica's ServerSettings: its key, the queue limits and timeouts and the tool-call
    settings the deployment config gives (the server's own defaults for those it leaves out)."""
    from pagellm.cluster.config import SERVER_LIMITS, SERVER_TOOL_SETTINGS
    from pagellm.server.app import ServerSettings

    names = SERVER_LIMITS + SERVER_TOOL_SETTINGS
    limits = {name: deployment[name] for name in names if deployment.get(name) is not None}
    return ServerSettings(
        model_name=model_name,
        max_model_len=max_model_len,
        api_key=deployment.get("api_key"),
        **limits,
    )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except (ImportError, RuntimeError):
        return "local"
