"""`pagellm cluster` on a two-node Ray cluster simulated on this machine (ray.cluster_utils:
two raylets on loopback, each with one replica slot): the controller starts one replica, scales
up to a second on the other node under a queue burst, a replica's process killed under load is
restarted by Ray while the gateway routes around it (every request completes or ends with a
clean error), the idle cluster scales back down, and `down` stops everything. A killed
controller is restarted by Ray and brings the gateway back at its address with fresh replicas."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
import yaml
from server_helpers import free_port, pid_alive, stream_outcome, wait_until

# Ray maps 127.0.0.1 to the machine's outward address unless this marks the cluster as one
# machine; set before Ray is imported, and inherited by its processes: all traffic on loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    store = 80 * 1024 * 1024
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"replica_slot": 1},
                        "object_store_memory": store, "include_dashboard": False,
                        "node_ip_address": "127.0.0.1"},
    )  # fmt: skip
    cluster.add_node(num_cpus=2, resources={"replica_slot": 1}, object_store_memory=store,
                     node_ip_address="127.0.0.1")  # fmt: skip
    ray.init(address=cluster.address, namespace="pagellm-test", log_to_driver=False,
             _node_ip_address="127.0.0.1")  # fmt: skip
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _config(model, port: int) -> dict:
    return {
        "deployment_config": {"model": str(model), "served_model_name": "tiny"},
        "engine_args": {"dtype": "float32", "max_model_len": 512, "kv_cache_memory": 0.02,
                        "max_num_seqs": 2},  # few seats, so a burst queues
        "ray_config": {"namespace": "pagellm-test", "name": "test-cluster", "num_replicas": 1,
                       "node_ip_address": "127.0.0.1",
                       "min_replicas": 1, "max_replicas": 2, "max_restarts": 3,
                       "resources_per_replica": {"CPU": 1, "replica_slot": 1},
                       "health_interval": 0.3, "upscale_queue_depth": 2, "upscale_delay": 0.3,
                       "downscale_delay": 6},
        "gateway": {"port": port, "routing": "least-load", "health_interval": 0.5,
                    "breaker_failures": 1, "breaker_reset": 1, "max_attempts": 3},
    }  # fmt: skip


def _up(status: dict) -> list[dict]:
    return [r for r in status["replicas"] if r["state"] == "up"]


def test_cluster_up_scale_restart_and_down(ray_cluster, tiny_models, tmp_path):
    from pagellm.cluster import api

    config = _config(tiny_models("llama"), free_port())
    gateway = api.up(config)
    try:
        assert len(_up(api.status(config))) == 1
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 48, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            burst = [pool.submit(stream_outcome, gateway, body) for _ in range(24)]
            wait_until(lambda: len(_up(api.status(config))) == 2, timeout=120, what="scale-up")
            assert [f.result() for f in burst] == ["done"] * 24
        nodes = {r["node"] for r in _up(api.status(config))}
        assert len(nodes) == 2  # one replica slot per node: the second went to the other node

        long = {**body, "max_tokens": 200}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            streams = [pool.submit(stream_outcome, gateway, long) for _ in range(12)]
            victim = _up(api.status(config))[0]
            wait_until(lambda: _load(config, victim["name"])["running"] > 0, what="busy victim")
            os.kill(int(_load(config, victim["name"])["pid"]), signal.SIGKILL)  # a crash
            outcomes = [f.result() for f in streams]
        assert set(outcomes) <= {"done", "error"}, outcomes  # never a silent cut
        assert "done" in outcomes
        for _ in range(4):  # meanwhile the gateway serves from what is up
            r = httpx.post(f"{gateway}/v1/completions", json={"model": "tiny", "prompt": "x",
                           "max_tokens": 2}, timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text

        def restarted() -> bool:
            rows = {r["name"]: r for r in api.status(config)["replicas"]}
            row = rows.get(victim["name"])
            return row is not None and row["state"] == "up" and row["restarts"] == 1

        wait_until(restarted, timeout=120, what="Ray to restart the replica")
        assert len(_up(api.status(config))) == 2
        wait_until(lambda: len(api.status(config)["replicas"]) == 1, timeout=60,
                   what="scale-down when idle")  # fmt: skip
        events = "\n".join(api.status(config)["events"])
        assert "scale up" in events and "restarted by Ray" in events and "scale down" in events
        # the command line, joining the running Ray cluster by its address
        file = tmp_path / "cluster.yaml"
        on_cluster = {**config, "ray_config": {**config["ray_config"],
                                               "address": ray_cluster.address}}  # fmt: skip
        file.write_text(yaml.safe_dump(on_cluster))
        cli = [sys.executable, "-m", "pagellm.cli", "cluster"]
        shown = subprocess.run([*cli, "status", "--config", str(file)], capture_output=True,
                               text=True, timeout=120, check=True)  # fmt: skip
        assert json.loads(shown.stdout)["gateway"] == gateway
        subprocess.run([*cli, "down", "--config", str(file)], timeout=180, check=True)
    finally:
        with contextlib.suppress(api.ClusterError):
            api.down(config)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{gateway}/health", timeout=2)
    with pytest.raises(api.ClusterError):
        api.status(config)


def _load(config: dict, name: str) -> dict:
    from pagellm.cluster import api

    rows = {r["name"]: r for r in api.status(config)["replicas"]}
    return rows[name]["load"]


def test_a_tensor_parallel_replica_places_its_ranks_on_two_nodes(ray_cluster, tiny_models):
    from pagellm import LLM, SamplingParams
    from pagellm.cluster import api

    model = tiny_models("llama")
    config = _config(model, free_port())
    config["engine_args"] = {**config["engine_args"], "tensor_parallel_size": 2}
    config["ray_config"] = {**config["ray_config"], "name": "tp-cluster", "max_replicas": 1,
                            "resources_per_replica": {"CPU": 2, "replica_slot": 2},
                            "placement_strategy": "STRICT_SPREAD"}  # fmt: skip
    prompt = "The quick brown fox"
    with LLM(str(model), dtype="float32", max_model_len=512, kv_cache_memory=0.02) as one:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        expected = one.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    gateway = api.up(config)
    try:
        (replica,) = api.status(config)["replicas"]
        assert len(set(replica["load"]["rank_nodes"])) == 2  # rank 0 and rank 1 on two nodes
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected  # TP 2 across nodes == one process
        (rank1,) = replica["load"]["rank_pids"]
        os.kill(rank1, signal.SIGKILL)  # a worker rank dies while the replica is idle

        def rebuilt() -> bool:
            (row,) = api.status(config)["replicas"]
            return row["restarts"] == 1 and row["state"] == "up"

        wait_until(rebuilt, timeout=120, what="the replica to be rebuilt with new ranks")
        events = "\n".join(api.status(config)["events"])
        assert "unhealthy; restarting it" in events
        again = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    finally:
        api.down(config)


def test_a_killed_controller_comes_back_with_its_gateway_and_replicas(ray_cluster, tiny_models):
    from pagellm.cluster import api

    config = _config(tiny_models("llama"), free_port())
    config["ray_config"] = {**config["ray_config"], "name": "restarting-cluster",
                            "max_replicas": 1}  # fmt: skip
    gateway = api.up(config)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    try:
        assert httpx.post(f"{gateway}/v1/completions", json=body, timeout=60).status_code == 200
        before = api.status(config)
        assert before["controller"]["restarted"] is False
        old_replica = int(_up(before)[0]["load"]["pid"])
        os.kill(before["controller"]["pid"], signal.SIGKILL)  # the gateway dies with it

        seen: dict[str, object] = {}  # the last status and error, for a failure's message

        def back() -> bool:
            """The restarted controller reports its replica up, and its gateway (at the same
            address) serves that replica's model."""
            try:
                now = seen["status"] = api.status(config, timeout=10)
                served = httpx.get(f"{gateway}/v1/models", timeout=5).json()["data"]
            except Exception as exc:  # noqa: BLE001 - the actor, or its gateway, is restarting
                seen["error"] = repr(exc)
                return False
            up = now["controller"]["restarted"] and len(_up(now)) == 1
            return up and [m["id"] for m in served] == ["tiny"]

        # a new process, Ray's restart, the gateway and a fresh replica loading its model:
        # minutes when other work shares the machine's 2 cores
        try:
            wait_until(back, timeout=420, what="Ray to restart the controller and its replica")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen: {seen}") from exc
        r = httpx.post(f"{gateway}/v1/completions", json=body, timeout=60)  # the same address
        assert r.status_code == 200, r.text
        after = api.status(config, timeout=60)
        assert "controller: restarted by Ray" in "\n".join(after["events"])
        assert int(_up(after)[0]["load"]["pid"]) != old_replica
        # Ray ends the replica the dead controller owned
        wait_until(lambda: not pid_alive(old_replica), timeout=60, what="the old replica to end")
    finally:
        with contextlib.suppress(api.ClusterError):
            api.down(config)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{gateway}/health", timeout=2)


def test_ray_ranks_outside_a_cluster_get_a_placement_group_of_their_own(ray_cluster, tiny_models):
    """``--distributed-executor-backend ray`` without `pagellm cluster`: the worker ranks are
    placed on a group the executor makes (and removes), and answer as the spawned ones do."""
    from ray.util.placement_group import placement_group_table

    from pagellm import LLM, SamplingParams

    def live_groups() -> int:
        return sum(g["state"] == "CREATED" for g in placement_group_table().values())

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    settings = dict(dtype="float32", max_model_len=256, kv_cache_memory=0.02,
                    tensor_parallel_size=2)  # fmt: skip
    model = str(tiny_models("llama"))
    with LLM(model, **settings) as spawned:
        expected = spawned.generate(["hello world"], params, use_tqdm=False)[0].outputs[0]
    before = live_groups()
    with LLM(model, **settings, distributed_executor_backend="ray") as on_ray:
        assert on_ray.engine.executor.ranks.own_group is not None
        assert live_groups() == before + 1
        got = on_ray.generate(["hello world"], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    wait_until(lambda: live_groups() == before, what="the ranks' placement group to go")
