"""benchmarks/locustfile.py runs headless against a real server for a few seconds: requests
succeed, none fail, and the TTFT and whole-answer rows are reported."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import API_KEY, MODEL_NAME, running_server

LOCUSTFILE = Path(__file__).resolve().parent.parent / "benchmarks" / "locustfile.py"


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")
def test_locust_scenario_runs_headless(tiny_models, tmp_path):
    # never imported here: importing locust monkey-patches the whole process with gevent
    with running_server(tiny_models("llama")) as (_, base):
        env = {**os.environ, "PAGELLM_API_KEY": API_KEY, "PAGELLM_MODEL": MODEL_NAME,
               "PAGELLM_MAX_TOKENS": "40", "PAGELLM_THINK_S": "0.1,0.3"}  # fmt: skip
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
               "-u", "4", "-r", "4", "-t", "8s", "--host", base, "--csv", str(tmp_path / "run"),
               "--only-summary", "--stop-timeout", "30"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "run_stats.csv", encoding="utf-8") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    chat, ttft = rows["chat"], rows["chat TTFT"]
    assert int(chat["Request Count"]) >= 4 and int(chat["Failure Count"]) == 0
    assert int(ttft["Request Count"]) == int(chat["Request Count"])
    assert float(ttft["50%"]) <= float(chat["50%"])
