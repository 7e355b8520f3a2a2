"""Command line: ``pagellm generate | bench``.

Engine flags are derived from the config dataclasses (``max_num_seqs`` -> ``--max-num-seqs``),
so the CLI, YAML keys and ``LLM(**kwargs)`` always agree.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import types
import typing
from typing import Any

from pagellm.config import EngineConfig, flat_fields
from pagellm.structured.tool_parsers import TOOL_CALL_PARSERS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per engine setting (defaults come from the dataclasses)."""
    group = parser.add_argument_group("engine")
    for name, field in flat_fields():
        flag = "--" + name.replace("_", "-")
        kind = _base_type(field.type)
        default = field.default if field.default is not dataclasses.MISSING else None
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            group.add_argument(flag, type=kind, default=default)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name, _ in flat_fields()}


def _base_type(annotation: Any) -> type:
    if isinstance(annotation, str):
        annotation = eval(annotation, {"typing": typing})  # noqa: S307 (our own annotations)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return args[0]
    return annotation


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


_port.__name__ = "int"  # argparse names the type in its message; config files check whole numbers


def _not_negative(kind: type, zero: bool) -> Any:
    """An argparse type: ``kind`` values of at least 0 (``zero``) or above 0."""

    def parse(text: str) -> Any:
        value = kind(text)
        if value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{text} must be {'0 or more' if zero else 'above 0'}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


def _above_zero(kind: type) -> Any:
    return _not_negative(kind, zero=False)


def _at_least_zero(kind: type) -> Any:
    return _not_negative(kind, zero=True)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        help="YAML file of settings named as the flags (max-num-seqs: 64); flags override it",
    )
    parser.set_defaults(subparser=parser)


def config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The YAML file's settings as parser defaults, checked like the flags would be."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"cannot read --config {path}: {exc}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of setting names to values")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config", "subparser")}
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None:
            parser.error(f"--config {path}: unknown setting {key!r}")
        values[dest] = _checked_value(parser, action, key, value)
    return values


def _checked_value(parser: argparse.ArgumentParser, action: argparse.Action, key: Any, value: Any):
    if isinstance(value, dict) and action.type is str:  # e.g. speculative-config as a mapping
        import json

        return json.dumps(value)
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # on/off flags
        if value is not None and not isinstance(value, bool):
            parser.error(f"--config: {key}: {value!r} is not true or false")
        return value
    if value is None or action.type is None or isinstance(value, bool):
        return value
    if getattr(action.type, "__name__", "") == "int" and isinstance(value, float):
        parser.error(f"--config: {key}: {value!r} is not a whole number")
    try:
        value = action.type(value)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--config: {key}: {exc}")
    except (TypeError, ValueError):
        parser.error(f"--config: {key}: {value!r} is not a valid {action.type.__name__}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"--config: {key}: {value!r} is not one of {list(action.choices)}")
    return value


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagellm.engine.sampling_params import SamplingParams
    from pagellm.llm import LLM

    try:  # a setting, a path or a prompt that cannot work: one line, as serve says it
        llm = LLM(**engine_kwargs(args))
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.sampling_seed,
        )
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"pagellm generate: {exc}") from exc
    print(outputs[0].outputs[0].text)
    return 0


def _draining_server_class() -> type:
    import signal

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """SIGTERM/SIGINT start uvicorn's graceful shutdown (stop accepting, let in-flight
        requests finish up to the timeout); unlike uvicorn's default the signal is not raised
        again afterwards, so a drained server exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            sigs = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return DrainingServer


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file's first line, else $PAGELLM_API_KEY or $VLLM_API_KEY (the
    last three keep the key out of the process list)."""
    if args.api_key is not None:
        if not args.api_key.strip():  # e.g. --api-key "$KEY" with KEY unset: not "no auth"
            raise SystemExit(
                "pagellm serve: --api-key is empty; give a key, or leave the flag out to serve "
                "without authentication"
            )
        return args.api_key
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as exc:
            raise SystemExit(f"pagellm serve: cannot read --api-key-file: {exc}") from exc
        if not key:
            raise SystemExit(f"pagellm serve: --api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get("PAGELLM_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def _add_body_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--client-body-timeout",
        type=_above_zero(float),
        default=60.0,
        help="seconds a request body may take to arrive whole; past them, 408 (nginx's name)",
    )


def _cmd_serve(args: argparse.Namespace) -> int:

    from pagellm.engine.async_engine import AsyncLLMEngine
    from pagellm.engine_factory import build_engine
    from pagellm.fetch import DEFAULT_FILE
    from pagellm.server.app import ServerSettings, build_app

    api_key = _api_key(args)
    try:
        engine, tokenizer = build_engine(EngineConfig.from_flat(**engine_kwargs(args)))
    except (ValueError, FileNotFoundError) as exc:  # a setting or path that cannot work here
        raise SystemExit(f"pagellm serve: {exc}") from exc
    default_name = args.model or DEFAULT_FILE.removesuffix(".gguf")
    settings = ServerSettings(
        model_name=args.served_model_name or default_name,
        max_model_len=engine.max_model_len,
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        max_num_queued_requests=args.max_num_queued_requests or None,
        max_num_queued_tokens=args.max_num_queued_tokens,
        request_timeout=args.request_timeout,
        max_seqs_per_request=args.max_seqs_per_request,
        metrics_need_key=not args.allow_unauthenticated_metrics,
        client_body_timeout=args.client_body_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        disable_ui=args.disable_ui,
    )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("pagellm serve: --enable-auto-tool-choice needs --tool-call-parser")
    front = AsyncLLMEngine(engine)
    front.start()
    try:
        _serve_until_drained(build_app(front, tokenizer, settings), args)
    finally:
        front.shutdown()
    return 0


def _serve_until_drained(app: Any, args: argparse.Namespace) -> None:
    """Run ``app`` on uvicorn until SIGTERM/SIGINT, draining in-flight requests."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    _draining_server_class()(config).run()


def _cmd_gateway(args: argparse.Namespace) -> int:
    from pagellm.gateway.app import Gateway, build_gateway_app
    from pagellm.gateway.config import ConfigError, GatewaySettings, read_fleet
    from pagellm.gateway.precheck import load_tokenizers

    try:
        fleet = read_fleet(args.config, tuple(args.backend))
    except ConfigError as exc:
        raise SystemExit(f"pagellm gateway: {exc}") from exc
    settings = GatewaySettings(
        fleet=fleet,
        routing=args.routing,
        max_attempts=args.max_attempts,
        health_interval=args.health_interval,
        breaker_failures=args.breaker_failures,
        breaker_reset=args.breaker_reset,
        upstream_timeout=args.upstream_timeout,
        max_body_bytes=args.max_body_bytes,
        client_body_timeout=args.client_body_timeout,
        metrics_need_key=not args.allow_unauthenticated_metrics,
        backend_api_key=args.backend_api_key,
        config_path=args.config,
        flag_backends=tuple(args.backend),
        disable_ui=args.disable_ui,
    )
    try:
        tokenizers = load_tokenizers(args.tokenizer)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagellm gateway: --tokenizer: {exc}") from exc
    _serve_until_drained(build_gateway_app(Gateway(settings, tokenizers=tokenizers)), args)
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    import json

    from pagellm.cluster.config import ClusterConfigError, load_cluster_config

    try:
        cfg = load_cluster_config(args.config)
    except ClusterConfigError as exc:
        raise SystemExit(f"pagellm cluster: {exc}") from exc
    if args.action == "up" and args.dry_run:
        print(json.dumps(cfg.plan(), indent=2))
        return 0
    from pagellm.cluster import api

    try:
        if args.action == "status":
            print(json.dumps(api.status(args.config), indent=2))
        elif args.action == "down":
            api.down(args.config)
            print(f"cluster {cfg.ray.name!r} is down")
        else:
            print(f"gateway: {api.up(args.config)}", flush=True)
            if cfg.ray.address is None:  # Ray lives in this process: stay up until a signal
                _wait_for_signal()
                _down_then_stop_ray(args.config)
    except api.ClusterError as exc:
        raise SystemExit(f"pagellm cluster: {exc}") from exc
    return 0


def _down_then_stop_ray(config: str, timeout: float = 60.0) -> None:
    """Stop the cluster (bounded: a terminal's Ctrl-C may have reached Ray's own processes
    too), then the Ray this process started, which ends whatever is left."""
    import threading

    import ray

    from pagellm.cluster import api

    stopper = threading.Thread(target=api.down, args=(config,), daemon=True)
    stopper.start()
    stopper.join(timeout)
    ray.shutdown()


def _wait_for_signal() -> None:
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap the prompt in the model's chat template (default on)",
    )
    add_engine_args(gen)
    add_config_arg(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every path but /health (default: "
        "--api-key-file, else $PAGELLM_API_KEY or $VLLM_API_KEY; none: no auth)",
    )
    serve.add_argument("--api-key-file", default=None, help="read the API key from this file")
    serve.add_argument(
        "--allow-unauthenticated-metrics",
        action="store_true",
        help="with an API key, leave /metrics open (for a Prometheus scraper)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=_above_zero(int),
        default=4 << 20,
        help="larger bodies get 413 (4 MiB)",
    )
    _add_body_timeout(serve)
    serve.add_argument(
        "--max-num-queued-requests",
        type=_at_least_zero(int),
        default=4096,
        help="sequences (prompts x n) admitted but not yet producing output; more get 503 "
        "with Retry-After (0: unbounded)",
    )
    serve.add_argument("--max-num-queued-tokens", type=_above_zero(int), default=None)
    serve.add_argument(
        "--max-seqs-per-request",
        type=_above_zero(int),
        default=256,
        help="most sequences (a completions request's prompts x n) one request may ask for",
    )
    serve.add_argument(
        "--request-timeout",
        type=_above_zero(float),
        default=None,
        help="abort a request this many seconds after it arrives and answer 504 (default: none)",
    )
    serve.add_argument(
        "--disable-ui", action="store_true", help="no web console at /ui (it is on by default)"
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": parse the model\'s own tool calls (needs --tool-call-parser)',
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the model's tool-call format for tool_choice auto",
    )
    serve.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    serve.add_argument(
        "--shutdown-timeout",
        type=_at_least_zero(float),
        default=30.0,
        help="on SIGTERM: stop accepting, let in-flight requests finish this long, exit 0",
    )
    add_engine_args(serve)
    add_config_arg(serve)
    serve.set_defaults(func=_cmd_serve)

    gw = sub.add_parser("gateway", help="one door in front of OpenAI-compatible replicas")
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=_port, default=8080)
    gw.add_argument("--backend", action="append", default=[], help="replica base URL (repeat)")
    gw.add_argument("--disable-ui", action="store_true", help="no fleet console at /ui")
    from pagellm.gateway.routing import ROUTING_POLICIES

    gw.add_argument("--routing", choices=ROUTING_POLICIES, default="least-load")
    gw.add_argument(
        "--max-attempts",
        type=_above_zero(int),
        default=2,
        help="replicas tried per request; another is tried only when one could not take the "
        "request (no connection, 502, 503 without Retry-After, a stream ended before its first "
        "event): any other answer is relayed as the replica's own",
    )
    gw.add_argument(
        "--health-interval", type=_above_zero(float), default=2.0, help="seconds between checks"
    )
    gw.add_argument(
        "--breaker-failures",
        type=_above_zero(int),
        default=3,
        help="consecutive failures that open a replica's breaker (failed health checks, lost "
        "connections, 502s and 503s without Retry-After; never a replica's other answers)",
    )
    gw.add_argument(
        "--breaker-reset", type=_at_least_zero(float), default=5.0, help="seconds before a probe"
    )
    gw.add_argument(
        "--upstream-timeout",
        type=_above_zero(float),
        default=600.0,
        help="seconds to wait on a replica's answer before answering 504 (never retried)",
    )
    _add_body_timeout(gw)
    gw.add_argument(
        "--allow-unauthenticated-metrics",
        action="store_true",
        help="with keys configured, leave /metrics open (for a Prometheus scraper)",
    )
    gw.add_argument(
        "--max-body-bytes",
        type=_above_zero(int),
        default=4 << 20,
        help="largest request body, counted as it arrives (after the key is checked); over "
        "it, 413 (default 4 MiB)",
    )
    gw.add_argument(
        "--backend-api-key",
        default=os.environ.get("PAGELLM_BACKEND_API_KEY"),
        help="key the replicas require (default $PAGELLM_BACKEND_API_KEY)",
    )
    gw.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=PATH",
        help="tokenizer of a served model for the prompt-length pre-check (repeat)",
    )
    gw.add_argument(
        "--config",
        default=None,
        help="YAML with 'backends' and 'fallbacks' (URLs), 'keys' (name, key_sha256, models, "
        "requests_per_minute, tokens_per_minute, max_concurrent, priority, tenant, "
        "allow_client_priority and allow_client_user (default false: the client's priority "
        "and user are dropped), max_tokens_default (default 1024: max_tokens set on requests "
        "without one under a tokens_per_minute limit)) and 'overload' (max_load, cap_at, "
        "max_tokens_cap, queue_size, queue_timeout); re-read when it changes, without a restart",
    )
    gw.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    gw.add_argument("--shutdown-timeout", type=_at_least_zero(float), default=30.0)
    gw.set_defaults(func=_cmd_gateway)

    cl = sub.add_parser("cluster", help="replicas on Ray behind the gateway")
    cl.add_argument("action", choices=["up", "status", "down"])
    cl.add_argument("--config", required=True, help="cluster YAML (deployment_config, "
                    "engine_args, ray_config, gateway)")  # fmt: skip
    cl.add_argument("--dry-run", action="store_true", help="up: print the resolved plan only")
    cl.set_defaults(func=_cmd_cluster)

    bench = sub.add_parser("bench", help="benchmarks that write JSON and print a table")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pagellm.bench import (
        batch_invariant,
        console,
        long_prompt,
        quant_kernels,
        quantization,
        reliability,
        step_profile,
        structured,
        throughput,
    )
    from pagellm.bench import serve as bench_serve

    throughput.add_parser(bench_sub)
    bench_serve.add_parser(bench_sub)
    reliability.add_parser(bench_sub)
    long_prompt.add_parser(bench_sub)
    quantization.add_parser(bench_sub)
    quant_kernels.add_parser(bench_sub)
    step_profile.add_parser(bench_sub)
    structured.add_parser(bench_sub)
    console.add_parser(bench_sub)
    batch_invariant.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) and hasattr(args, "subparser"):  # the gateway reads its own
        args.subparser.set_defaults(**config_defaults(args.subparser, args.config))
        args = parser.parse_args(argv)  # flags given on the command line win over the file
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
