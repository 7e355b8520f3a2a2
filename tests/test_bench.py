"""Fast tests of the throughput benchmark's workloads and report (no model is loaded)."""

from __future__ import annotations

import json

import pytest

from pagellm.bench import datasets as ds
from pagellm.bench import report as rep


class CharTokenizer:
    """One token per character, so lengths in the tests are easy to reason about."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]


def _conv(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": who, "value": text} for who, text in turns]}


def _write_sharegpt(tmp_path, entries: list[dict]) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries, indent=2))
    return str(path)


def test_random_workload_lengths_and_range() -> None:
    reqs = ds.random_workload(5, input_len=32, output_len=7, vocab_size=1000, seed=0)
    assert len(reqs) == 5
    assert all(len(r.prompt_token_ids) == 32 and r.output_len == 7 for r in reqs)
    ids = [t for r in reqs for t in r.prompt_token_ids]
    assert min(ids) >= ds.SPECIAL_MARGIN and max(ids) < 1000 - ds.SPECIAL_MARGIN
    assert all(isinstance(t, int) for t in ids)


def test_random_workload_is_seeded() -> None:
    a = ds.random_workload(3, 8, 4, 1000, seed=1)
    b = ds.random_workload(3, 8, 4, 1000, seed=1)
    c = ds.random_workload(3, 8, 4, 1000, seed=2)
    assert a == b
    assert a != c


def test_random_workload_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        ds.random_workload(1, 0, 4, 1000, seed=0)
    with pytest.raises(ValueError):
        ds.random_workload(1, 4, 4, 150, seed=0)


def test_sharegpt_pairs_take_first_human_then_gpt(tmp_path) -> None:
    path = _write_sharegpt(
        tmp_path,
        [
            _conv(("human", "hello there"), ("gpt", "general kenobi"), ("human", "x")),
            _conv(("system", "be nice"), ("human", "question"), ("gpt", "answer")),
            _conv(("human", "only one turn")),
            _conv(("gpt", "reply first"), ("gpt", "again")),
            _conv(("human", "a"), ("human", "b")),
            {"id": "empty", "conversations": []},
        ],
    )
    assert ds.sharegpt_pairs(path) == [("hello there", "general kenobi"), ("question", "answer")]


def test_sharegpt_filters() -> None:
    assert ds.is_valid_pair(4, 4)
    assert not ds.is_valid_pair(3, 100)  # prompt too short
    assert not ds.is_valid_pair(100, 3)  # output too short
    assert not ds.is_valid_pair(1025, 10)  # prompt too long
    assert not ds.is_valid_pair(1000, 1049)  # prompt + output > 2048
    assert ds.is_valid_pair(1024, 1024)


def test_sharegpt_workload_applies_filters_and_lengths(tmp_path) -> None:
    entries = [
        _conv(("human", "abc"), ("gpt", "long enough reply")),  # prompt < 4
        _conv(("human", "long enough prompt"), ("gpt", "no")),  # output < 4
        _conv(("human", "p" * 1100), ("gpt", "fine reply")),  # prompt > 1024
        _conv(("human", "p" * 1000), ("gpt", "r" * 1100)),  # total > 2048
    ] + [_conv(("human", "q" * (10 + i)), ("gpt", "a" * (5 + i))) for i in range(6)]
    path = _write_sharegpt(tmp_path, entries)
    reqs = ds.sharegpt_workload(path, CharTokenizer(), num_prompts=6, seed=0)
    assert sorted(len(r.prompt_token_ids) for r in reqs) == [10, 11, 12, 13, 14, 15]
    assert all(r.output_len == len(r.prompt_token_ids) - 5 for r in reqs)
    again = ds.sharegpt_workload(path, CharTokenizer(), num_prompts=6, seed=0)
    assert reqs == again
    with pytest.raises(ValueError, match="pass the filters"):
        ds.sharegpt_workload(path, CharTokenizer(), num_prompts=7, seed=0)


def test_sharegpt_truncated_file_keeps_complete_entries(tmp_path) -> None:
    entries = [
        _conv(("human", f"prompt number {i}"), ("gpt", f"reply number {i}")) for i in range(3)
    ]
    text = json.dumps(entries, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex("reply number 2") + 5])  # cut mid-string
    with pytest.warns(UserWarning, match="truncated"):
        pairs = ds.sharegpt_pairs(path)
    assert pairs == [(f"prompt number {i}", f"reply number {i}") for i in range(2)]


def test_json_array_prefix_complete_and_empty() -> None:
    assert ds.read_json_array_prefix('[ {"a": 1} , [2] ]') == ([{"a": 1}, [2]], True)
    assert ds.read_json_array_prefix("[]") == ([], True)
    assert ds.read_json_array_prefix('[{"a": 1},') == ([{"a": 1}], False)
    with pytest.raises(ValueError):
        ds.read_json_array_prefix('{"a": 1}')


def test_workload_round_trip(tmp_path) -> None:
    reqs = ds.random_workload(4, 6, 3, 1000, seed=3)
    path = tmp_path / "workload.json"
    ds.save_workload(path, reqs)
    data = json.loads(path.read_text())
    assert data[0].keys() == {"prompt_token_ids", "output_len"}
    assert ds.load_workload(path) == reqs


def test_workload_summary() -> None:
    reqs = [ds.BenchRequest([1, 2, 3], 4), ds.BenchRequest([5], 2)]
    summary = ds.workload_summary(reqs)
    assert summary["prompt_tokens"] == 4 and summary["output_tokens"] == 6
    assert summary["mean_prompt_len"] == 2.0


def _engine_figures() -> dict:
    extra = {
        "peak_memory_mib": 900.0,
        "peak_kv_usage_frac": 0.5,
        "kv_waste_frac": 0.1,
        "num_preemptions": 0,
        "num_steps": 20,
        "expected_output_tokens": 400,
    }
    return rep.PhaseResult(10, 300, 400, 2.0, extra).to_dict()


def _baseline_figures() -> dict:
    single = rep.PhaseResult(2, 60, 80, 4.0).to_dict()
    static = rep.PhaseResult(4, 120, 160, 2.0, {"batch_size": 2}).to_dict()
    return {"hf_single": single, "hf_static": static}


ENV = {"torch_version": "test", "num_threads": 1}
REQUIRED = [
    "engine.output_tokens_per_s",
    "engine.requests_per_s",
    "engine.total_tokens_per_s",
    "engine.peak_memory_mib",
    "engine.kv_waste_frac",
    "engine.peak_kv_usage_frac",
    "engine.num_preemptions",
    "baseline.hf_single.output_tokens_per_s",
    "baseline.hf_static.output_tokens_per_s",
    "ratios.vs_hf_single",
    "ratios.vs_hf_static",
    "config",
    "git_sha",
    "timestamp",
    "torch_version",
    "num_threads",
]


def _get(doc: dict, dotted: str):
    for key in dotted.split("."):
        doc = doc[key]
    return doc


def test_phase_rates() -> None:
    engine = _engine_figures()
    assert engine["requests_per_s"] == 5.0
    assert engine["output_tokens_per_s"] == 200.0
    assert engine["total_tokens_per_s"] == 350.0


def test_report_has_required_keys_and_ratios(tmp_path) -> None:
    report = rep.build_report(
        {"dataset": "random"}, _engine_figures(), _baseline_figures(), env=ENV
    )
    path = tmp_path / "out" / "report.json"
    rep.write_report(path, report)
    loaded = json.loads(path.read_text())
    for key in REQUIRED:
        _get(loaded, key)  # KeyError if missing
    assert loaded["ratios"]["vs_hf_single"] == pytest.approx(200.0 / 20.0)
    assert loaded["ratios"]["vs_hf_static"] == pytest.approx(200.0 / 80.0)
    text = rep.render(loaded)
    assert "pagellm" in text and "hf static (bs 2)" in text and "subsets" in text


def test_report_without_baseline_has_null_ratios() -> None:
    report = rep.build_report({"dataset": "random"}, _engine_figures(), None, env=ENV)
    assert report["baseline"] == {"hf_single": None, "hf_static": None}
    assert report["ratios"] == {"vs_hf_single": None, "vs_hf_static": None}
    text = rep.render(report)
    assert "hf single" not in text and "subsets" not in text


def test_format_table_aligns_columns() -> None:
    table = rep.format_table(["name", "n"], [["a", "1"], ["longer", "100"]])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[3].startswith("longer")


def test_cli_accepts_engine_and_bench_flags() -> None:
    from pagellm.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "throughput", "--dataset", "sharegpt", "--num-prompts", "4", "--dtype",
         "float32", "--max-num-seqs", "8", "--kv-cache-memory", "0.25", "--baseline", "hf",
         "--seed", "3", "--output-json", "x.json"]
    )  # fmt: skip
    assert args.dataset == "sharegpt" and args.num_prompts == 4 and args.seed == 3
    assert args.max_num_seqs == 8 and args.kv_cache_memory == 0.25 and args.baseline == "hf"
    assert callable(args.func)


def test_sharegpt_output_len_override(tmp_path) -> None:
    entries = [_conv(("human", "q" * (10 + i)), ("gpt", "no")) for i in range(3)]
    path = _write_sharegpt(tmp_path, entries)
    reqs = ds.sharegpt_workload(path, CharTokenizer(), num_prompts=3, seed=0, output_len=2)
    assert [r.output_len for r in reqs] == [2, 2, 2]  # short replies pass when overridden


def test_render_names_a_loaded_workload() -> None:
    config = {"dataset": "random", "workload": "/tmp/w.json", "resolved_dtype": "float32"}
    text = rep.render(rep.build_report(config, _engine_figures(), None, env=ENV))
    assert "workload=/tmp/w.json" in text and "dtype=float32" in text


def test_current_rss_is_positive_on_linux() -> None:
    rss = rep.current_rss_mib()
    assert rss is None or rss > 0


def test_prefix_workload_shares_prefixes_and_resends_history() -> None:
    reqs = ds.prefix_workload(
        3, prefix_len=20, input_len=5, output_len=4, vocab_size=1000, seed=0, num_turns=2
    )
    assert len(reqs) == 6 and all(r.output_len == 4 for r in reqs)
    first, second = reqs[:3], reqs[3:]
    assert all(len(r.prompt_token_ids) == 25 for r in first)
    assert len({tuple(r.prompt_token_ids[:20]) for r in first}) == 1  # one shared system prompt
    for a, b in zip(first, second, strict=True):  # turn 2 = turn 1 + a reply + new input
        assert b.prompt_token_ids[:25] == a.prompt_token_ids
        assert len(b.prompt_token_ids) == 25 + 4 + 5
    two = ds.prefix_workload(4, 8, 2, 2, 1000, seed=1, num_prefixes=2)
    assert two[0].prompt_token_ids[:8] == two[2].prompt_token_ids[:8]
    assert two[0].prompt_token_ids[:8] != two[1].prompt_token_ids[:8]


def test_bench_step_splits_a_decode_step_into_parts(tiny_models, tmp_path) -> None:
    """``pagellm bench step`` on the tiny model: every part is measured, the parts add up to
    the step, and every timed step runs the whole batch (the prefill takes several steps here,
    in which the first requests already decode: none may finish before the timing ends)."""
    from pagellm.bench.step_profile import PARTS
    from pagellm.cli import main

    out = tmp_path / "step.json"
    argv = [
        "bench", "step", "--model", str(tiny_models("llama")), "--dtype", "float32",
        "--kv-cache-memory", "0.05", "--max-model-len", "256", "--batch-sizes", "1,3",
        "--context-len", "40", "--steps", "4", "--warmup-steps", "1",
        "--max-num-batched-tokens", "32", "--output-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["batch_size"] for r in report["results"]] == [1, 3]
    for row in report["results"]:
        ms = row["ms_per_step"]
        assert row["mean_sequences"] == row["batch_size"]
        assert row["mean_context"] > 40
        assert row["captured"]  # decode steps run captured by default: attention inside layers
        assert ms["attention"] is None
        assert all(ms[p] >= 0 for p in PARTS if p != "attention")
        assert ms["layers"] > 0 and ms["lm_head"] > 0
        assert sum(ms[p] or 0 for p in PARTS) == pytest.approx(ms["step"], rel=1e-6)
    assert main([*argv, "--enforce-eager"]) == 0
    for row in json.loads(out.read_text())["results"]:
        ms = row["ms_per_step"]
        assert not row["captured"] and ms["attention"] > 0 and ms["layers"] > 0
        assert sum(ms[p] for p in PARTS) == pytest.approx(ms["step"], rel=1e-6)
