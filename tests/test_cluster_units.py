"""The cluster file and the autoscaler's rule (no Ray, injected clock)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from fakes import FakeClock as Clock

from pagellm.cluster.autoscale import Autoscaler, Load
from pagellm.cluster.config import ClusterConfigError, parse_cluster_config

GOOD = {
    "deployment_config": {"model": "/models/x", "served_model_name": "x"},
    "engine_args": {"tensor_parallel_size": 2, "max_num_seqs": 64, "block_size": 16,
                    "enable_chunked_prefill": True, "max_num_batched_tokens": 1024,
                    "max_model_len": 2048, "gpu_memory_utilization": 0.9,
                    "kv_cache_dtype": "fp8"},
    "ray_config": {"address": "auto", "num_replicas": 2, "min_replicas": 1, "max_replicas": 4,
                   "resources_per_replica": {"CPU": 4, "node_b": 1}},
    "gateway": {"port": 9000, "routing": "prefix-affinity",
                "keys": [{"name": "a", "key_sha256": "0" * 64}], "overload": {"max_load": 8}},
}  # fmt: skip


def test_the_plan_of_a_good_file():
    plan = parse_cluster_config(GOOD).plan()
    assert plan["replicas"] == {
        "initial": 2,
        "min": 1,
        "max": 4,
        "max_restarts": 3,
        "controller_max_restarts": -1,
    }
    assert plan["per_replica"]["ranks"] == 2
    bundles = plan["per_replica"]["placement_group"]["bundles"]
    assert bundles == [{"CPU": 2.0, "node_b": 0.5}] * 2  # the replica's resources per rank
    assert plan["engine_args"]["parallel"]["tensor_parallel_size"] == 2
    assert plan["engine_args"]["scheduler"]["max_num_seqs"] == 64
    assert plan["gateway"]["url"] == "http://127.0.0.1:9000"
    assert plan["engine_args"]["cache"]["gpu_memory_utilization"] == 0.9
    assert plan["engine_args"]["cache"]["kv_cache_dtype"] == "fp8"


def test_speculative_config_as_a_mapping_becomes_the_flag():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    plan = parse_cluster_config({**GOOD, "engine_args": {"speculative_config": spec}}).plan()
    assert json.loads(plan["engine_args"]["speculative"]["speculative_config"]) == spec


def test_structured_outputs_and_tool_settings_reach_the_replicas():
    from pagellm.cluster.replica import server_settings

    engine = {"structured_outputs_config": {"disable_any_whitespace": True}}
    tools = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    config = parse_cluster_config({**GOOD, "engine_args": engine, "deployment_config": tools})
    plan = config.plan()
    flag = plan["engine_args"]["structured"]["structured_outputs_config"]
    assert json.loads(flag) == {"disable_any_whitespace": True}
    settings = server_settings(dataclasses.asdict(config.deployment), "m", 512)
    assert settings.enable_auto_tool_choice and settings.tool_call_parser == "hermes"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"engine_args": {"structured_outputs_config": {"backend": "outlines"}}}, "backend"),
        ({"deployment_config": {"enable_auto_tool_choice": True}}, "tool_call_parser"),
        ({"deployment_config": {"tool_call_parser": "mistral"}}, "tool_call_parser"),
        ({"replicas": 2}, "'replicas'"),
        ({"engine_args": {"max_num_seq": 64}}, "'max_num_seq'"),
        ({"engine_args": {"max_num_seqs": "many"}}, "engine_args.max_num_seqs"),
        ({"engine_args": {"quantization": "fp4"}}, "quantization"),
        ({"engine_args": {"kv_cache_dtype": "int4"}}, "kv_cache_dtype"),
        ({"engine_args": {"model": "/m"}}, "deployment_config"),
        ({"engine_args": {"speculative_config": {"method": "eagle"}}}, "not supported"),
        ({"engine_args": {"num_speculative_tokens": 3}}, "needs a method"),
        ({"ray_config": {"num_replica": 2}}, "'num_replica'"),
        ({"ray_config": {"num_replicas": 3, "max_replicas": 2}}, "max_replicas"),
        ({"ray_config": {"placement_strategy": "TIGHT"}}, "placement_strategy"),
        ({"gateway": {"routing": "random"}}, "routing"),
        ({"engine_args": {"device": "tpu"}}, "engine_args.device"),
        ({"ray_config": {"resources_per_replica": {"CPU": 2, "GPU": 1}}}, "one GPU per rank"),
        ({"gateway": {"prot": 1}}, "'prot'"),
        ({"deployment_config": {"served_name": "x"}}, "'served_name'"),
        ({"engine_args": {"block_size": 0}}, "block_size must be at least 1"),
        ({"engine_args": {"tensor_parallel_size": 0}}, "tensor_parallel_size"),
        ({"engine_args": {"enable_prefix_caching": "false"}}, "true or false"),
        ({"engine_args": {"kv_cache_memory": -1}}, "kv_cache_memory must be above 0"),
        ({"ray_config": {"resources_per_replica": {"CPU": "two"}}}, "resources_per_replica.CPU"),
        ({"ray_config": {"resources_per_replica": {"CPU": -2}}}, "resources_per_replica.CPU"),
        ({"ray_config": {"start_timeout": 0}}, "start_timeout"),
        ({"ray_config": {"upscale_delay": -5}}, "upscale_delay"),
        ({"gateway": {"port": 70000}}, "gateway.port"),
        ({"gateway": {"max_attempts": 0}}, "max_attempts"),
    ],
)
def test_bad_files_name_the_key(change, named):
    with pytest.raises(ClusterConfigError, match=named):
        parse_cluster_config({**GOOD, **change})


def test_cluster_up_dry_run_prints_the_plan(tmp_path):
    import yaml

    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    cmd = [sys.executable, "-m", "pagellm.cli", "cluster", "up", "--config", str(cfg), "--dry-run"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(out.stdout)["replicas"]["max"] == 4
    cfg.write_text(yaml.safe_dump({**GOOD, "ray_config": {"nodes": 2}}))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "'nodes'" in bad.stderr


def test_autoscaler_adds_after_a_sustained_queue_and_removes_when_idle():
    clock = Clock(step=0.0)
    scaler = Autoscaler(1, 3, queue_depth=4, upscale_delay=5, downscale_delay=30, clock=clock)
    assert scaler.desired(Load(1, waiting=10, running=2)) == 1  # busy, not for long yet
    clock.now = 4
    assert scaler.desired(Load(1, waiting=10, running=2)) == 1
    clock.now = 5
    assert scaler.desired(Load(1, waiting=10, running=2)) == 2
    clock.now = 6  # one step at a time: the next needs a full delay again
    assert scaler.desired(Load(2, waiting=10, running=4)) == 2
    clock.now = 8
    assert scaler.desired(Load(2, waiting=6, running=4)) == 2  # 3 per replica: not busy
    clock.now = 20
    assert scaler.desired(Load(2, waiting=20, running=4)) == 2  # busy again from t=20
    clock.now = 25
    assert scaler.desired(Load(2, waiting=20, running=4)) == 3
    clock.now = 40
    assert scaler.desired(Load(3, waiting=50, running=6)) == 3  # at max_replicas
    assert scaler.desired(Load(3, waiting=0, running=0)) == 3  # idle from t=40
    clock.now = 69
    assert scaler.desired(Load(3, waiting=0, running=1)) == 3  # a request: idleness restarts
    clock.now = 70
    assert scaler.desired(Load(3, waiting=0, running=0)) == 3
    clock.now = 100
    assert scaler.desired(Load(3, waiting=0, running=0)) == 2
    assert scaler.desired(Load(0, waiting=0, running=0)) == 1  # below min: back to min


# ----- replicas reachable from elsewhere, and the server limits they get ----------------------

LOCAL = {"deployment_config": {"model": "/models/x"}}


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "node-a.internal", "::"])
def test_a_replica_reachable_from_elsewhere_needs_an_api_key(host):
    with pytest.raises(ClusterConfigError, match="deployment_config.api_key"):
        parse_cluster_config({"deployment_config": {"replica_host": host}})
    keyed = {"deployment_config": {"replica_host": host, "api_key": "k"}}
    assert parse_cluster_config(keyed).deployment.replica_host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_a_loopback_replica_may_be_open(host):
    assert parse_cluster_config({"deployment_config": {"replica_host": host}}).deployment


def test_replicas_get_the_queue_limits_and_timeouts_of_the_deployment():
    from pagellm.cluster.controller import _deployment
    from pagellm.cluster.replica import server_settings

    limits = {"max_num_queued_requests": 32, "max_num_queued_tokens": 8192,
              "request_timeout": 90.5, "max_body_bytes": 65536}  # fmt: skip
    cfg = parse_cluster_config({"deployment_config": {**LOCAL["deployment_config"], **limits,
                                                      "api_key": "k"}})  # fmt: skip
    settings = server_settings(_deployment(cfg), "x", 2048)
    assert {name: getattr(settings, name) for name in limits} == limits
    assert (settings.model_name, settings.max_model_len, settings.api_key) == ("x", 2048, "k")
    unset = server_settings(_deployment(parse_cluster_config(LOCAL)), "x", 2048)
    assert unset.max_body_bytes == 4 << 20 and unset.request_timeout is None  # the server's
    for bad in ({"max_num_queued_requests": 0}, {"request_timeout": -1}, {"max_body_bytes": "1"}):
        with pytest.raises(ClusterConfigError, match=next(iter(bad))):
            parse_cluster_config({"deployment_config": bad})


def test_the_gateways_keys_are_checked_with_the_file():
    bad = {"gateway": {"keys": [{"name": "a", "key": "k", "models": [[1]]}]}}
    with pytest.raises(ClusterConfigError, match="models"):
        parse_cluster_config(bad)
    with pytest.raises(ClusterConfigError, match="queue_sise"):
        parse_cluster_config({"gateway": {"overload": {"queue_sise": 3}}})


# ----- the controller's supervision, with Ray's calls faked -----------------------------------


@pytest.fixture
def controller(monkeypatch):
    pytest.importorskip("ray")
    from pagellm.cluster import controller as module

    monkeypatch.setattr(module, "_was_restarted", lambda: False)

    def make(**ray_config) -> module.ClusterController:
        return module.ClusterController({**LOCAL, "ray_config": ray_config})

    return make


def test_supervision_goes_on_after_an_unexpected_error(controller):
    import asyncio

    c = controller(health_interval=0.01)
    rounds = []

    async def flaky_sync() -> None:
        rounds.append(1)
        if len(rounds) <= 2:
            raise RuntimeError("boom")

    async def steady() -> None:
        return None

    c._sync_gateway, c._scale = flaky_sync, steady

    async def scenario() -> None:
        task = asyncio.create_task(c._supervise())
        while len(rounds) < 3:
            assert not task.done(), task
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert sum("RuntimeError: boom" in event for event in c.events) == 2


def test_a_replica_that_cannot_be_placed_is_given_up_after_the_start_timeout(
    controller, monkeypatch
):
    import asyncio
    import importlib

    groups = importlib.import_module("ray.util.placement_group")  # the module, not the function
    removed = []

    class Unplaceable:
        def ready(self) -> asyncio.Future:
            return asyncio.get_running_loop().create_future()  # never: no node has room

    monkeypatch.setattr(groups, "placement_group", lambda bundles, strategy: Unplaceable())
    monkeypatch.setattr(groups, "remove_placement_group", removed.append)
    c = controller(start_timeout=0.2)
    placed = asyncio.run(asyncio.wait_for(c._add_replica(), 10))
    assert placed is False and c.slots == []
    assert len(removed) == 1 and isinstance(removed[0], Unplaceable)
    assert any("could not be placed" in event for event in c.events), c.events


def test_a_restarted_controller_resumes_through_a_retried_call_to_itself(controller, monkeypatch):
    """Sent while Ray still has the actor restarting, the call may be refused: only a retried
    one surely reaches the restarted controller."""
    import asyncio

    import ray

    from pagellm.cluster import controller as module

    sent = []

    class Method:
        def options(self, **options):
            sent.append(options)
            return self

        def remote(self):
            sent.append("sent")

    class Context:
        current_actor = type("Actor", (), {"resume": Method(), "start": Method()})()

    monkeypatch.setattr(module, "_was_restarted", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", Context)
    c = module.ClusterController(LOCAL)
    assert sent and sent[0]["max_task_retries"] >= 1 and sent[-1] == "sent"
    started = []

    async def start() -> str:
        started.append(1)
        c._gateway = object()
        return "url"

    c.start = start
    asyncio.run(c.resume())
    asyncio.run(c.resume())  # a retried call that arrives after all: nothing twice
    assert started == [1]


def test_a_model_path_missing_here_is_noted_not_refused(tmp_path):
    """The model path is each node's: the dry run names one this machine lacks, and goes on."""
    missing = parse_cluster_config(GOOD).plan()["notes"]
    assert any("'/models/x' does not exist on this machine" in n for n in missing)
    here = {**GOOD, "deployment_config": {"model": str(tmp_path)}}
    assert not any("does not exist" in n for n in parse_cluster_config(here).plan()["notes"])
