"""Settings refused at start-up with one line naming them (engine, serve and gateway flags,
their YAML files, the offline API), instead of a traceback, a hang or a silent misreading."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from llm_helpers import tiny_llm

from pagellm.cli import _api_key, build_parser, config_defaults
from pagellm.config import EngineConfig, ParallelConfig, SchedulerConfig
from pagellm.engine.sampling_params import ParamError, SamplingParams
from pagellm.engine_factory import check_fits_model
from pagellm.gateway.config import ConfigError, read_fleet


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be true or false"),
        ({"enforce_eager": "off"}, "enforce_eager must be true or false"),
        ({"max_num_seqs": 1.7}, "max_num_seqs must be an integer"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be at least 1"),
        ({"block_size": 0}, "block_size must be at least 1"),
        ({"block_size": -16}, "block_size"),
        ({"kv_cache_memory": -1}, "kv_cache_memory must be above 0"),
        ({"num_gpu_blocks_override": -3}, "num_gpu_blocks_override"),
        ({"swap_space": -1}, "swap_space"),
        ({"max_model_len": 0}, "max_model_len must be at least 1"),
        ({"max_model_len": -5}, "max_model_len"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"pipeline_parallel_size": -1}, "pipeline_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": 16}, "dtype must be a string"),
        ({"long_prefill_layer_parts": 0}, "long_prefill_layer_parts must be at least 1"),
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
        ({"long_prefill_decode_budget": -1}, "long_prefill_decode_budget"),
    ],
)
def test_engine_settings_out_of_type_or_range_are_refused(setting, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig.from_flat(**setting)


def test_good_settings_and_json_mappings_pass():
    config = EngineConfig.from_flat(
        max_num_seqs=8, kv_cache_memory=1, swap_space=0, enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )  # fmt: skip
    assert config.scheduler.max_num_seqs == 8 and not config.cache.enable_prefix_caching
    assert EngineConfig.from_flat(model=Path("/m.gguf")).model.model == Path("/m.gguf")


def test_settings_the_model_cannot_meet():
    no_chunks = EngineConfig(scheduler=SchedulerConfig(256, 512, enable_chunked_prefill=False))
    with pytest.raises(ValueError, match="max_num_batched_tokens=512 is below max_model_len=2048"):
        check_fits_model(no_chunks, 2048, 30)
    check_fits_model(no_chunks, 512, 30)
    deep = EngineConfig(parallel=ParallelConfig(pipeline_parallel_size=50))
    with pytest.raises(ValueError, match="pipeline_parallel_size=50 exceeds the model's 30"):
        check_fits_model(deep, 2048, 30)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "70000"],
        ["serve", "--port", "-1"],
        ["serve", "--log-level", "bogus"],
        ["serve", "--max-body-bytes", "0"],
        ["serve", "--max-seqs-per-request", "0"],
        ["serve", "--request-timeout", "0"],
        ["serve", "--client-body-timeout", "-1"],
        ["gateway", "--port", "65536"],
        ["gateway", "--health-interval", "0"],
        ["gateway", "--max-attempts", "0"],
        ["gateway", "--upstream-timeout", "-1"],
    ],
)
def test_server_flags_out_of_range_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert argv[1] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("disable-ui: 'false'\n", "disable-ui: 'false' is not true or false"),
        ("enable-prefix-caching: 'no'\n", "is not true or false"),
        ("max-num-seqs: 1.7\n", "max-num-seqs: 1.7 is not a whole number"),
        ("port: 8000.7\n", "port: 8000.7 is not a whole number"),
        ("max-body-bytes: 0\n", "max-body-bytes: 0 must be above 0"),
    ],
)
def test_a_config_file_value_of_the_wrong_kind_or_range_names_its_key(
    tmp_path, capsys, text, named
):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    with pytest.raises(SystemExit):
        config_defaults(serve, str(path))
    assert named in capsys.readouterr().err


def test_an_empty_api_key_is_not_taken_for_no_key():
    args = argparse.Namespace(api_key="", api_key_file=None)
    with pytest.raises(SystemExit, match="--api-key is empty"):
        _api_key(args)
    assert _api_key(argparse.Namespace(api_key="k", api_key_file=None)) == "k"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("backends: [http://a]\nkeys: [{name: a, key_sha256: xyz}]\n", "64 hex digits"),
        (
            "backends: [http://a]\nkeys: [{name: a, key: k1}, {name: b, key: k1}]\n",
            "keys\\[1\\] repeats",
        ),
        ("backends: [http://a]\noverload: {queue_size: -5}\n", "queue_size"),
        ("backends: [notaurl]\n", "not an http\\(s\\) URL"),
    ],
)
def test_gateway_files_with_unusable_values_are_refused(tmp_path, text, named):
    path = tmp_path / "gw.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named):
        read_fleet(path)


def test_a_backend_flag_must_be_a_url():
    with pytest.raises(ConfigError, match="--backend"):
        read_fleet(None, ("127.0.0.1:8000",))
    assert read_fleet(None, ("http://127.0.0.1:8000/",)).backends == ("http://127.0.0.1:8000",)


def test_the_offline_api_refuses_bad_calls_and_keeps_working(tiny_models):
    llm = tiny_llm(tiny_models)
    good = SamplingParams(max_tokens=2, temperature=0)
    changed = SamplingParams(max_tokens=2)
    changed.n = 0  # changed after it was made: checked again
    with pytest.raises(ParamError, match="n"):
        llm.generate("hi", changed)
    for prompts in (None, 5, {"prompt": "hi"}, [[1.5, 2]], [[True, 2]]):
        with pytest.raises(TypeError):
            llm.generate(prompts, good)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate("hi", {"max_tokens": 2})
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(["a", "b"], good, priority=[0])
    for messages in ([{"role": 5, "content": "x"}], [{"role": "user"}], []):
        with pytest.raises((TypeError, ValueError)):
            llm.chat(messages, good)
    with pytest.raises(ValueError, match="not valid Unicode"):  # a lone surrogate
        llm.generate("a\udcff", good)
    with pytest.raises(ValueError):  # the second prompt is refused: the first is not left queued
        llm.generate(["a good one", [10**9]], good)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["one", [5, 6, 7]], good)
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 2]
