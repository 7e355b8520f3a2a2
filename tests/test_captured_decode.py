"""Captured decode steps (pagellm/runner/captured.py): the same tokens as eager steps and as
transformers, in batches, under chunked prefill, prefix hits, preemption (recompute and swap)
and block tables that outgrow the captured ones; the fused glue ops against the eager modules;
vLLM's --enforce-eager / --compilation-config settings."""

from __future__ import annotations

import json

import pytest
import torch
from llm_helpers import MIXED_PROMPTS, greedy, tiny_llm
from reference import compare_greedy, hf_greedy

from pagellm import LLM, SamplingParams
from pagellm.config import CompilationConfig
from pagellm.runner.capture_settings import max_capture_size


def _tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def _captured_steps(llm: LLM) -> int:
    captured = llm.engine.executor.captured
    return 0 if captured is None else captured.num_steps


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_captured_greedy_matches_transformers_and_eager(tiny_models, arch):
    import transformers

    path = tiny_models(arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (3, 33, 90)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    captured = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=512)
    eager = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=512,
                enforce_eager=True)  # fmt: skip
    ours = _tokens(captured.generate(prompts, params, use_tqdm=False))
    assert _captured_steps(captured) >= 19 and eager.engine.executor.captured is None
    assert ours == _tokens(eager.generate(prompts, params, use_tqdm=False))
    for i, prompt in enumerate(prompts):
        compare_greedy(ours[i], hf_greedy(hf, prompt, 20), f"{arch}#{i}")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_captured_equals_eager_under_chunks_prefix_hits_and_preemption(tiny_models, mode):
    """A small cache and small steps: chunked prefill, prefix-cache hits and preemption all
    happen while other sequences decode captured."""
    kw = dict(num_gpu_blocks_override=16, max_model_len=256, max_num_batched_tokens=24,
              preemption_mode=mode, swap_space=0.01)  # fmt: skip
    params = greedy([60, 40, 50, 70, 45, 55])
    captured = tiny_llm(tiny_models, **kw)
    eager = tiny_llm(tiny_models, enforce_eager=True, **kw)
    ours = _tokens(captured.generate(MIXED_PROMPTS, params, use_tqdm=False))
    assert ours == _tokens(eager.generate(MIXED_PROMPTS, params, use_tqdm=False))
    assert captured.get_stats().num_preemptions > 0
    assert _captured_steps(captured) > 10
    assert len(captured.engine.executor.captured.plans) > 1  # several batch sizes


def test_captured_bf16_equals_eager(tiny_models):
    """bf16 rounds where the eager model rounds (norm, rotary, SiLU, residual adds)."""
    prompts = [list(range(200, 200 + n)) for n in (4, 17, 50, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = tiny_llm(tiny_models, dtype="bfloat16", enforce_eager=eager)
        outs.append(_tokens(llm.generate(prompts, params, use_tqdm=False)))
    assert outs[0] == outs[1]


def test_block_tables_wider_than_captured_ones(tiny_models):
    """Block size 2: a 300-token context needs 150 blocks, more than the first tables hold;
    the tables widen and the plans are built again."""
    prompt = list(range(1000, 1300))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    captured = tiny_llm(tiny_models, block_size=2, kv_cache_memory=0.01)
    eager = tiny_llm(tiny_models, block_size=2, kv_cache_memory=0.01, enforce_eager=True)
    ours = _tokens(captured.generate([prompt], params, use_tqdm=False))
    assert ours == _tokens(eager.generate([prompt], params, use_tqdm=False))
    assert captured.engine.executor.captured.inputs.block_tables.shape[1] >= 151


def test_capture_sizes_bound_the_captured_batch(tiny_models):
    llm = tiny_llm(tiny_models, compilation_config={"cudagraph_capture_sizes": [1, 2]})
    eager = tiny_llm(tiny_models, enforce_eager=True)
    prompts = ["one", "two two", "three three three"]
    params = greedy([12, 12, 12])
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(
        eager.generate(prompts, params, use_tqdm=False)
    )
    assert {rows for rows, *_ in llm.engine.executor.captured.plans} <= {1, 2}
    assert llm.engine.executor.captured.max_size == 2


def test_unsupported_settings_run_eager(tiny_models):
    fp8 = tiny_llm(tiny_models, kv_cache_dtype="fp8")
    assert fp8.engine.executor.captured is None
    qwen3 = LLM(str(tiny_models("qwen3")), dtype="float32", kv_cache_memory=0.01,
                max_model_len=512)  # fmt: skip
    assert qwen3.engine.executor.captured is None
    out = qwen3.generate(["hello"], greedy([4])[0], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_match_the_eager_modules(dtype):
    from pagellm.kernels.decode_ops import DTYPE_CODES, load_decode_ops
    from pagellm.layers.norm import RMSNorm
    from pagellm.layers.rotary import RotaryEmbedding, inverse_frequencies

    ops = load_decode_ops()
    assert ops is not None
    code, gen = DTYPE_CODES[dtype], torch.Generator().manual_seed(0)
    rows = 5

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            _within_one_ulp(got, want)

    for hidden in (96, 100):  # 100: a tail narrower than the vector width
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        residual = torch.randn(rows, hidden, generator=gen).to(dtype)
        norm = RMSNorm(hidden, 1e-5).to(dtype)
        norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
        out = torch.empty_like(x)
        res = residual.clone()
        assert ops.add_rms_norm(code, x.data_ptr(), res.data_ptr(), norm.weight.data_ptr(),
                                out.data_ptr(), rows, hidden, 1e-5, 2) == 0  # fmt: skip
        expected_res = residual + x
        assert torch.equal(res, expected_res)
        with torch.no_grad():
            close(out, norm(expected_res))
        no_residual = 0
        assert ops.add_rms_norm(code, x.data_ptr(), no_residual, norm.weight.data_ptr(),
                                out.data_ptr(), rows, hidden, 1e-5, 2) == 0  # fmt: skip
        with torch.no_grad():
            close(out, norm(x))

    hq, hkv, d = 3, 1, 16
    rotary = RotaryEmbedding(d, 64, inverse_frequencies(d, 10000.0, None, None))
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.tensor([0, 5, 9, 33, 63])
    k_cache = torch.zeros(hkv, 4, 16, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, -1, 40, 63])
    q_out = torch.empty(rows, hq, d, dtype=dtype)
    assert ops.rope_kv_write(code, qkv.data_ptr(), positions.data_ptr(), rotary.cos.data_ptr(),
                             rotary.sin.data_ptr(), q_out.data_ptr(), k_cache.data_ptr(),
                             v_cache.data_ptr(), slots.data_ptr(), rows, hq, hkv, d, 64, 2) == 0  # fmt: skip
    heads = qkv.view(rows, hq + 2 * hkv, d)
    rotated = rotary(positions, heads[:, : hq + hkv])
    assert torch.equal(q_out, rotated[:, :hq])
    for r, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(k_cache.view(hkv, 64, d)[:, slot], rotated[r, hq:])
        assert torch.equal(v_cache.view(hkv, 64, d)[:, slot], heads[r, hq + hkv :])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(64) if s not in written]
    assert not k_cache.view(hkv, 64, d)[:, untouched].any()

    inter = 40
    gate_up = torch.randn(rows, 2 * inter, generator=gen).to(dtype)
    act = torch.empty(rows, inter, dtype=dtype)
    assert ops.silu_mul(code, gate_up.data_ptr(), act.data_ptr(), rows, inter, 2) == 0
    gate, up = gate_up.split(inter, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(act, expected, rtol=1e-6, atol=1e-6)
    else:
        _within_one_ulp(act, expected)


def test_bf16_silu_over_the_whole_float_range():
    """bf16's SiLU takes a cheaper sigmoid (reciprocal estimate and a Newton step): finite
    everywhere (e^-x overflows below ~-88, where the step would give inf * 0), zero there as
    torch's, and within one bf16 step of torch's elsewhere."""
    from pagellm.kernels.decode_ops import load_decode_ops

    ops = load_decode_ops()
    assert ops is not None
    x = torch.linspace(-200, 200, 40001).bfloat16()
    gate_up = torch.cat([x, torch.ones_like(x)]).view(1, -1)
    act = torch.empty(1, x.numel(), dtype=torch.bfloat16)
    assert ops.silu_mul(1, gate_up.data_ptr(), act.data_ptr(), 1, x.numel(), 2) == 0
    act = act.view(-1)
    expected = torch.nn.functional.silu(x)
    assert bool(torch.isfinite(act).all())
    assert bool((act[x < -89] == 0).all())
    normal = x > -80
    _within_one_ulp(act[normal], expected[normal])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5, 16, 17, 1000])
def test_argmax_kernel_matches_torch_ties_nans_and_strides(dtype, vocab):
    from pagellm.kernels.decode_ops import load_decode_ops

    ops = load_decode_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(10, vocab, generator=gen).to(dtype)
    x[1] = 0  # all tied: the first index
    x[2, vocab // 2] = float("nan")  # NaN wins, as in torch
    x[3, -1] = float("nan")  # in the tail past the vector chunks
    x[4] = float("-inf")
    x[5, 0] = float("nan")
    x[6, -1] = 100.0
    x[7, 1::2] = 7.0  # ties across vector lanes: still the first
    assert ops.argmax(x) == x.argmax(dim=-1).tolist()
    rows = torch.randn(40, vocab + 3, generator=gen).to(dtype)[:, 1 : vocab + 1]  # row stride
    assert ops.argmax(rows) == rows.argmax(dim=-1).tolist()
    strided = torch.randn(6, 2 * vocab, generator=gen).to(dtype)[:, ::2]  # not contiguous
    assert ops.argmax(strided) == strided.argmax(dim=-1).tolist()


def _within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 values equal but where float32 summation order moved a rounding by one step."""
    diff = (actual.float() - expected.float()).abs()
    ulp = expected.float().abs() * 2.0**-7 + 1e-30
    assert bool((diff <= ulp).all()), float((diff / ulp).max())
    assert (actual == expected).float().mean() > 0.97


def test_capture_settings_follow_vllm():
    assert max_capture_size(CompilationConfig(), 256) == 512
    assert max_capture_size(CompilationConfig(), 8) == 16
    assert max_capture_size(CompilationConfig(enforce_eager=True), 8) == 0
    sizes = json.dumps({"cudagraph_capture_sizes": [1, 2, 4, 24]})
    assert max_capture_size(CompilationConfig(compilation_config=sizes), 256) == 24
    assert max_capture_size(CompilationConfig(compilation_config={"max_capture_size": 5}), 8) == 5
    off = {"cudagraph_mode": "NONE", "level": 3}
    assert max_capture_size(CompilationConfig(compilation_config=off), 8) == 0
    for bad in ({"cudagraph_capture_sizes": [0]}, {"cudagraph_capture_sizes": "8"},
                {"no_such_key": 1}, {"use_cudagraph": "yes"}, "[1, 2]", "{not json"):  # fmt: skip
        with pytest.raises(ValueError, match="compilation-config"):
            max_capture_size(CompilationConfig(compilation_config=bad), 8)


def test_bad_compilation_config_fails_before_loading(tiny_models):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        tiny_llm(tiny_models, compilation_config='{"cudagraph_capture_sizes": [-1]}')


def test_cluster_file_takes_compilation_config_mapping(tmp_path):
    from pagellm.cluster.config import ClusterConfigError, load_cluster_config

    def write(engine_args: str):
        path = tmp_path / "cluster.yaml"
        path.write_text(
            "deployment_config:\n  served_model_name: x\nengine_args:\n" + engine_args,
            encoding="utf-8",
        )
        return path

    ok = load_cluster_config(write("  compilation_config:\n    cudagraph_capture_sizes: [1, 8]\n"))
    assert json.loads(ok.engine_args["compilation_config"]) == {"cudagraph_capture_sizes": [1, 8]}
    with pytest.raises(ClusterConfigError, match="compilation-config"):
        load_cluster_config(write("  compilation_config:\n    cudagraph_capture_sizes: oops\n"))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verify_steps_run_captured_and_keep_greedy_exact(tiny_models, method):
    """Under speculative decoding a step's rows are each sequence's last token and its
    proposals: captured, each row attends up to its own position, and greedy outputs equal the
    eager engine's without speculation."""
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        spec["model"] = str(tiny_models("llama"))  # the model itself: proposals are accepted
    prompts = ["one two three four five one two three", "a b a b a b a", *MIXED_PROMPTS[:3]]
    params = greedy([30] * len(prompts))
    reference = _tokens(
        tiny_llm(tiny_models, enforce_eager=True).generate(prompts, params, use_tqdm=False)
    )
    llm = tiny_llm(tiny_models, speculative_config=spec)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    stats = llm.get_stats()
    assert stats.spec_num_drafts > 0
    if method == "draft_model":  # a random model's text rarely repeats: n-gram proposals miss
        assert stats.spec_num_accepted_tokens > 0
    captured = llm.engine.executor.captured
    assert any(rows > len(prompts) for rows, *_ in captured.plans)  # steps with proposals' rows


def test_block_table_rows_follow_changed_blocks_of_equal_count():
    """A request may hold as many blocks as before but other ones (its speculative proposals'
    block trimmed and another allocated, or a preempted request back with new blocks): the
    captured step's table must follow the ids, not the count."""
    from pagellm.engine.outputs import ScheduledRequest
    from pagellm.runner.captured import StepInputs

    inputs = StepInputs(rows=2, table_width=4)

    def step(blocks: list[int]) -> list[int]:
        s = ScheduledRequest("r", [7], 17, blocks, True, SamplingParams(), 0, [1], [], None)
        inputs.fill([s], block_size=16)
        return inputs.block_tables[0, : len(blocks)].tolist()

    assert step([3, 5]) == [3, 5]
    assert step([3, 9]) == [3, 9]
    assert inputs.slots[0].item() == 9 * 16 + 1


def _prompts_beside_streams(
    llm: LLM,
    streams: dict[str, list[int]],
    stream_tokens: int,
    prompts: dict[str, list[int]],
    prompt_tokens: int,
    warm_steps: int,
) -> dict[str, list[int]]:
    """Greedy streams decode for ``warm_steps`` steps, then the prompts arrive while they go on;
    every request's tokens once all have finished."""
    engine = llm.engine

    def add(requests: dict[str, list[int]], max_tokens: int) -> None:
        for rid, ids in requests.items():
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(rid, ids, params)

    add(streams, stream_tokens)
    for _ in range(warm_steps):
        engine.step()
    add(prompts, prompt_tokens)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


def test_long_prompt_chunks_beside_decodes_go_through_the_prefill_kernel(tiny_models):
    """A long prompt's cut chunks (and a second prompt's) while others decode: captured steps
    attend them with the prefill kernel, chunks last in the step, and every token equals the
    eager engine's and transformers'."""
    import transformers

    path = tiny_models("llama")
    kw = dict(dtype="float32", kv_cache_memory=0.02, max_model_len=512,
              long_prefill_token_threshold=16, long_prefill_decode_budget=40,
              max_num_partial_prefills=2,
              max_long_partial_prefills=2)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    streams = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (5, 9, 14)]
    longs = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (300, 130)]

    def run(llm: LLM) -> dict[str, list[int]]:
        return _prompts_beside_streams(
            llm, {f"s{i}": p for i, p in enumerate(streams)}, 90,
            {f"l{i}": p for i, p in enumerate(longs)}, 6, warm_steps=3,
        )  # fmt: skip

    captured = LLM(str(path), **kw)
    ours = run(captured)
    decoder = captured.engine.executor.captured
    assert decoder.num_kernel_chunks > 10
    assert any(chunks == 2 for _, _, chunks, *_ in decoder.plans)  # both prompts in one step
    assert ours == run(LLM(str(path), enforce_eager=True, **kw))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for i, prompt in enumerate(longs):
        compare_greedy(ours[f"l{i}"], hf_greedy(hf, prompt, 6), f"long#{i}")
    compare_greedy(ours["s2"], hf_greedy(hf, streams[2], 90), "stream#2")


def test_small_chunks_take_the_prefill_kernel_where_its_smallest_item_is_cheaper(
    tmp_path, default_tokenizer_dir
):
    """A prompt cut into 3-4 token chunks beside a decoding stream, bf16, head_dim 64: a captured
    step sends a chunk to the prefill kernel from half the kernel's smallest work item on (4
    tokens at a group of 2 where bf16 items of 16 rows run on AMX tiles, 8 elsewhere), as rows
    below that; the tokens equal the eager engine's either way."""
    import shutil

    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    for f in default_tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    kw = dict(dtype="bfloat16", kv_cache_memory=0.02, max_model_len=256,
              long_prefill_token_threshold=8, long_prefill_decode_budget=4)  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    stream = torch.randint(100, 40000, (6,), generator=gen).tolist()
    prompt = torch.randint(100, 40000, (40,), generator=gen).tolist()

    def run(llm: LLM) -> dict[str, list[int]]:
        return _prompts_beside_streams(llm, {"s": stream}, 40, {"p": prompt}, 4, warm_steps=1)

    captured = LLM(str(tmp_path), **kw)
    decoder = captured.engine.executor.captured
    if decoder is None or decoder.prefill_kernel is None:
        pytest.skip("no captured steps or no C++ prefill kernel here")
    ours = run(captured)
    smallest = captured.engine.executor.backend.prefill_item_rows()
    assert decoder.min_chunk_tokens == -(-smallest // 4)
    if smallest < decoder.prefill_kernel.item_rows:  # half items on AMX: 4-token chunks
        assert decoder.min_chunk_tokens == 4 and decoder.num_kernel_chunks > 0
    else:
        assert decoder.num_kernel_chunks == 0
    assert ours == run(LLM(str(tmp_path), enforce_eager=True, **kw))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_deep_chunks_spread_over_steps_keep_every_token(tiny_models, mode):
    """Layered prefill: a long prompt's chunks that cost more than the decode budget go
    through the layers over several captured steps beside decoding streams (the chunk is
    scheduled again until it is whole), under preemption too; every token equals the same
    engine's without layered steps, the eager engine's and transformers'."""
    import transformers

    path = tiny_models("llama")
    kw = dict(dtype="float32", max_model_len=512, long_prefill_token_threshold=16,
              long_prefill_decode_budget=4, num_gpu_blocks_override=40, preemption_mode=mode,
              swap_space=0.01)  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    streams = {f"s{i}": torch.randint(100, 40000, (n,), generator=gen).tolist()
               for i, n in enumerate((5, 9, 14))}  # fmt: skip
    prompt = torch.randint(100, 40000, (400,), generator=gen).tolist()

    def run(llm: LLM) -> dict[str, list[int]]:
        return _prompts_beside_streams(llm, streams, 120, {"long": prompt}, 6, warm_steps=3)

    layered = LLM(str(path), **kw)
    ours = run(layered)
    decoder = layered.engine.executor.captured
    assert decoder.layered.num_parts > 10
    assert any(end < len(layered.engine.executor.model.layers) for *_, end in decoder.plans)
    assert layered.get_stats().num_preemptions > 0
    assert ours == run(LLM(str(path), long_prefill_layer_parts=1, **kw))
    assert ours == run(LLM(str(path), enforce_eager=True, **kw))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    compare_greedy(ours["long"], hf_greedy(hf, prompt, 6), "long")


def test_a_parked_chunk_resumes_only_as_it_left():
    """The chunk between its layer shares: the next share only for the same request, first
    position, tokens and blocks; anything else (a preemption moved its blocks, the scheduler
    cut another chunk, it ended) starts again from the first layer."""
    from types import SimpleNamespace

    from pagellm.engine.outputs import ScheduledRequest
    from pagellm.runner.captured import LayeredChunk

    model = SimpleNamespace(arch=SimpleNamespace(hidden_size=8))
    layered = LayeredChunk(4, model, torch.float32)

    def chunk(start: int = 40, blocks: tuple[int, ...] = (1, 2, 3), parts: int = 3):
        return ScheduledRequest("long", [5, 6], start, list(blocks), False, SamplingParams(),
                                0, [], [], None, layer_parts=parts)  # fmt: skip

    def step(s: ScheduledRequest, num_chunks: int = 1) -> tuple[int, int, str | None]:
        first, end = layered.layers([s], num_chunks, 8)
        return first, end, layered.ran(end, 8)

    assert step(chunk()) == (0, 3, "long")
    assert step(chunk()) == (3, 5, "long")
    assert step(chunk()) == (5, 8, None)
    assert step(chunk()) == (0, 3, "long")  # whole: a new chunk at the same place starts over
    assert step(chunk(blocks=(1, 2, 4))) == (0, 3, "long")
    assert step(chunk(start=41)) == (0, 3, "long")
    layered.forget(["other"])
    assert step(chunk(start=41)) == (3, 5, "long")
    layered.forget(["long"])
    assert step(chunk(start=41)) == (0, 3, "long")
    assert step(chunk(start=41, parts=1)) == (0, 8, None)  # the scheduler no longer spreads it
    assert step(chunk(start=41)) == (0, 3, "long")
    assert step(chunk(start=41), num_chunks=2) == (0, 8, None)
    assert layered.num_parts == 9
