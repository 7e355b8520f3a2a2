"""``pagellm bench long-prompt`` against a real server on loopback: per-length rows and the
fairness scenario's three windows (before, during and after a long prompt's prefill)."""

from __future__ import annotations

import json

from server_helpers import API_KEY, MODEL_NAME, running_server

from pagellm.bench.long_prompt import Stream, render
from pagellm.cli import main


def test_gap_windows() -> None:
    s = Stream(sent=0.0, chunk_times=[1.0, 2.0, 4.0, 7.0, 11.0])
    assert s.gaps(after=2.0, until=7.0) == [2.0, 3.0]  # later chunk in (2, 7]
    assert s.gaps(2.0, 11.0, whole=True) == [2.0, 3.0, 4.0]  # both chunks in [2, 11]
    assert s.gaps(3.0, 11.0, whole=True) == [3.0, 4.0]  # the gap 2 -> 4 began before 3
    assert s.gaps(12.0, 20.0, whole=True) == []


def _run(base: str, out, *args: str) -> dict:
    rc = main(
        [
            "bench", "long-prompt", "--base-url", base, "--api-key", API_KEY,
            "--output-json", str(out), *args,
        ]
    )  # fmt: skip
    assert rc == 0
    return json.loads(out.read_text())


def test_long_prompt_bench_lengths_and_fairness(tiny_models, tmp_path, capsys) -> None:
    with running_server(tiny_models("llama")) as (proc, base):
        lengths = _run(
            base, tmp_path / "lengths.json", "--input-lens", "40,200", "--num-prompts", "2",
            "--output-len", "5", "--server-pid", str(proc.pid),
        )  # fmt: skip
        fair = _run(
            base, tmp_path / "fair.json", "--fairness", "--streams", "2",
            "--stream-input-len", "8", "--stream-max-tokens", "480", "--fairness-input-len",
            "300", "--baseline-s", "0.5", "--after-s", "0.5",
        )  # fmt: skip
    assert lengths["model"] == MODEL_NAME
    rows = lengths["lengths"]
    assert [r["input_len"] for r in rows] == [40, 200]
    for r in rows:
        assert (r["completed"], r["failed"]) == (2, 0)
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0 and r["peak_rss_mib"] > 0
        assert r["prefill_tokens_per_s"] > 0

    f = fair["fairness"]
    assert f["long_error"] is None and f["stream_errors"] == []
    assert (f["streams"], f["long_input_len"]) == (2, 300)
    assert f["long_ttft_ms"] > 0 and f["gaps_before"] > 0
    for window in ("before", "during", "after"):  # a window without gaps reports none
        assert (f[f"itl_{window}_p99_ms"] is None) == (f[f"gaps_{window}"] == 0)
    table = render(fair)
    assert "after its first token" in table and "during / after" in table
    assert "before it" in capsys.readouterr().out
