"""``pagellm bench serve`` against a real server on loopback, and its statistics."""

from __future__ import annotations

import json
import math

import numpy as np
from server_helpers import API_KEY, MODEL_NAME, running_server

from pagellm.bench import serve as bs
from pagellm.cli import main


def test_poisson_arrivals_are_seeded_and_at_the_rate() -> None:
    a = bs.arrival_offsets(4000, rate=20.0, seed=3)
    assert a == bs.arrival_offsets(4000, rate=20.0, seed=3)
    gaps = np.diff([0.0, *a])
    assert all(g >= 0 for g in gaps)
    assert abs(gaps.mean() - 1 / 20) < 0.005  # mean gap 1/rate
    assert abs(gaps.std() - 1 / 20) < 0.005  # exponential: std equals the mean
    assert bs.arrival_offsets(3, rate=math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_summary_statistics_and_tpot() -> None:
    ok = bs.RequestResult(True, 10, output_tokens=5, ttft=0.1, e2e=0.5, chunk_gaps=[0.1] * 4)
    ok2 = bs.RequestResult(True, 6, output_tokens=1, ttft=0.3, e2e=0.3)
    bad = bs.RequestResult(False, 7, error="HTTP 400: nope")
    s = bs.summarize([ok, ok2, bad], duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 16
    assert s["output_throughput"] == 3.0 and s["request_throughput"] == 1.0
    assert abs(s["mean_tpot_ms"] - 100.0) < 1e-9  # (0.5 - 0.1) / 4; one-token requests skipped
    assert abs(s["median_ttft_ms"] - 200.0) < 1e-9
    assert abs(s["p99_itl_ms"] - 100.0) < 1e-9
    assert s["errors"] == ["HTTP 400: nope"]


def test_bench_serve_against_our_server(tiny_models, tmp_path, capsys) -> None:
    model = tiny_models("llama")
    out = tmp_path / "serve.json"
    with running_server(model) as (_, base):
        rc = main(
            [
                "bench", "serve", "--base-url", base, "--dataset", "random",
                "--tokenizer", str(model), "--input-len", "12", "--output-len", "9",
                "--num-prompts", "12", "--max-concurrency", "4", "--request-rate", "50",
                "--api-key", API_KEY, "--output-json", str(out),
            ]
        )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    r = report["results"]
    assert report["model"] == MODEL_NAME  # asked the server's /v1/models
    assert (r["completed"], r["failed"]) == (12, 0)
    assert r["total_output_tokens"] == 12 * 9 and r["total_input_tokens"] == 12 * 12
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert r[f"{stat}_{key}_ms"] > 0
    server = report["server"]
    assert server["generation_tokens"] >= 12 * 9
    assert 0 < server["engine_busy_frac"] <= 1.0
    assert "TTFT" in capsys.readouterr().out


def test_bench_serve_counts_failures(tiny_models, tmp_path) -> None:
    model = tiny_models("llama")
    out = tmp_path / "serve.json"
    with running_server(model) as (_, base):
        rc = main(
            [
                "bench", "serve", "--base-url", base, "--model", MODEL_NAME, "--dataset",
                "random", "--tokenizer", str(model), "--input-len", "4", "--output-len", "2",
                "--num-prompts", "3", "--api-key", "wrong", "--output-json", str(out),
            ]
        )  # fmt: skip
    assert rc == 1
    r = json.loads(out.read_text())["results"]
    assert (r["completed"], r["failed"]) == (0, 3)
    assert r["errors"] and r["errors"][0].startswith("HTTP 401")
