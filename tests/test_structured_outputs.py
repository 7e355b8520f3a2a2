"""Structured outputs in the engine (tiny random Llama, xgrammar): sampled outputs always match
their schema, regex or choice; unconstrained requests beside them are unchanged; preemption,
swap and n-gram speculation keep the grammar state consistent; a grammar that does not compile
fails its request alone; a slow compilation holds back only its own request.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import threading

import jsonschema
import pytest
from llm_helpers import MIXED_PROMPTS, greedy, tiny_llm
from schema_gen import schemas

from pagellm import SamplingParams
from pagellm.engine.errors import RequestRejected
from pagellm.structured.params import StructuredOutputError, StructuredOutputsParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return tiny_llm(tiny_models, kv_cache_memory=0.05)


def constrained(seed: int, max_tokens: int = 300, temperature: float = 1.0, **constraint):
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def run_engine(engine, max_steps: int = 2000) -> dict:
    """Step until every request ended; the finished outputs by request id."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return finished


@pytest.mark.parametrize("no_whitespace, least", [(True, 90), (False, 25)])
def test_sampled_outputs_match_100_json_schemas(llm, no_whitespace, least):
    """With free whitespace the random model often wanders in it until max_tokens: fewer
    answers complete, and every one that does must still match."""
    cases = schemas(100, seed=1)
    params = [
        constrained(i, json=s, disable_any_whitespace=no_whitespace) for i, s in enumerate(cases)
    ]
    outs = llm.generate(["Answer in JSON:"] * len(cases), params, use_tqdm=False)
    completed = 0
    for schema, out in zip(cases, outs, strict=True):
        comp = out.outputs[0]
        assert out.error is None
        if comp.finish_reason == "stop":
            completed += 1
            jsonschema.validate(json.loads(comp.text), schema)
    assert completed >= least, completed
    stats = llm.get_stats()
    assert stats.structured_output_requests["json"] >= 100
    assert stats.structured_mask_steps > 0


def test_sampled_outputs_match_regex_and_choice(llm):
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}( ok)?"
    choices = ["yes", "no", 'say "maybe"', "naïve \\ path"]
    params = [constrained(i, regex=pattern) for i in range(20)]
    params += [constrained(i, choice=choices) for i in range(20)]
    params += [constrained(i, json_object=True, disable_any_whitespace=True) for i in range(10)]
    outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    reasons = [o.outputs[0].finish_reason for o in outs]
    assert reasons[:40] == ["stop"] * 40, list(zip(reasons, texts, strict=True))
    assert all(re.fullmatch(pattern, t) for t in texts[:20]), texts[:20]
    assert all(t in choices for t in texts[20:40]), texts[20:40]
    assert len(set(texts[20:40])) > 1  # sampled, not one answer every time
    objects = [t for t, r in zip(texts[40:], reasons[40:], strict=True) if r == "stop"]
    assert objects and all(isinstance(json.loads(t), dict) for t in objects)


def test_unconstrained_greedy_outputs_unchanged_beside_constrained(llm):
    plain = greedy([24] * len(MIXED_PROMPTS))
    alone = llm.generate(MIXED_PROMPTS, plain, use_tqdm=False)
    cases = schemas(8, seed=2)
    mixed_params = plain + [constrained(i, json=s) for i, s in enumerate(cases)]
    mixed = llm.generate(MIXED_PROMPTS + ["{"] * len(cases), mixed_params, use_tqdm=False)
    for a, b in zip(alone, mixed, strict=False):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_greedy_outputs_survive_preemption(tiny_models, mode):
    cases = schemas(12, seed=3)
    params = [constrained(0, 160, 0.0, json=s, disable_any_whitespace=True) for s in cases]
    params += [constrained(0, 160, 0.0, regex=r"(ab|cd|ef){1,60}")]
    prompts = [f"request {i}: " + "pad " * (i % 5) for i in range(len(params))]
    roomy = tiny_llm(tiny_models, kv_cache_memory=0.05)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = tiny_llm(
        tiny_models, num_gpu_blocks_override=24, block_size=8, preemption_mode=mode,
        num_host_blocks_override=256, max_model_len=192,
    )  # fmt: skip
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    if mode == "swap":
        assert tight.get_stats().num_preemptions_swap > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_ngram_speculation_keeps_constrained_greedy_outputs(tiny_models):
    params = [constrained(0, 120, 0.0, regex=r"(ab|abc|cd){1,80}")]
    params += [constrained(0, 120, 0.0, json={"type": "array", "items": {"enum": [1, 22, 333]}})]
    prompts = ["ab ab ab ab", "[1, 22, 333, 1, 22, 333"]
    plain = tiny_llm(tiny_models)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3})  # fmt: skip
    fast = tiny_llm(tiny_models, speculative_config=spec)
    outs = fast.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = fast.get_stats()
    assert stats.spec_num_draft_tokens > 0


def test_ngram_proposals_past_the_grammars_end_are_cut(tiny_models):
    """The prompt holds the constrained answer followed by the end of a turn and more text, so
    the n-gram proposal after the answer is its stop token and tokens beyond it: the stop
    token is not proposed (no bitmask row can follow it) and the request ends as without
    speculation (this had stopped the engine)."""
    prompt = "The answer is yes<|im_end|>\nThe answer is yes<|im_end|>\nThe answer is"
    params = [constrained(0, 10, 0.0, choice=[" yes"]), greedy([12])[0]]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 5})  # fmt: skip
    fast = tiny_llm(tiny_models, speculative_config=spec)
    outs = fast.generate([prompt, prompt], params, use_tqdm=False)
    assert outs[0].outputs[0].text == " yes" and outs[0].outputs[0].finish_reason == "stop"
    plain = tiny_llm(tiny_models).generate([prompt, prompt], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert fast.generate(["again"], greedy([4]), use_tqdm=False)[0].outputs[0].token_ids


def test_a_grammar_that_fails_while_stepping_fails_its_request_alone(llm, monkeypatch):
    """An error from the grammar library while a step's bitmasks are built ends that request
    with the error, and the batch runs on."""
    engine = llm.engine
    structured = engine.structured
    real = structured._fill_in_budget

    def fill(seq_id, proposal):  # on the fill thread: its exception reaches the engine
        if seq_id.startswith("broken"):
            raise RuntimeError("grammar_matcher.cc: check failed")
        return real(seq_id, proposal)

    monkeypatch.setattr(structured, "_fill_in_budget", fill)
    engine.add_request("broken", "x", constrained(0, 20, 0.0, regex="[ab]{1,20}"))
    engine.add_request("fine", "y", constrained(0, 20, 0.0, regex="[ab]{5}"))
    engine.add_request("plain", "z", greedy([6])[0])
    finished = run_engine(engine)
    assert "check failed" in finished["broken"].error
    assert re.fullmatch("[ab]{5}", finished["fine"].outputs[0].text)
    assert len(finished["plain"].outputs[0].token_ids) == 6
    assert not engine.has_unfinished_requests()


def test_grammar_that_does_not_compile_fails_alone(llm):
    for bad, match in (({"type": "objectx"}, "objectx"), ("{nope", "not valid JSON")):
        with pytest.raises(StructuredOutputError, match=match):
            llm.generate(["x", "y"], [greedy([8])[0], constrained(0, json=bad)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # past the front end (the engine compiles asynchronously): that request fails alone
    # (a compilation that has already failed when the request arrives rejects it at once)
    engine = llm.engine
    try:
        engine.add_request("bad-regex", "x", constrained(0, regex="[a-"))
    except StructuredOutputError as exc:
        why = str(exc)
        engine.add_request("fine", "y", greedy([8])[0])
        finished = run_engine(engine)
    else:
        engine.add_request("fine", "y", greedy([8])[0])
        finished = run_engine(engine)
        why = finished["bad-regex"].error
    assert "Unclosed" in why
    assert finished["fine"].error is None
    assert len(finished["fine"].outputs[0].token_ids) == 8


def test_a_constraint_too_slow_to_compile_fails_its_request_alone(llm, monkeypatch):
    """A 100-byte schema pattern that compiles for minutes: its worker is stopped at the
    deadline, its request ends as a bad request, and the requests beside it run on."""
    engine = llm.engine
    monkeypatch.setattr(engine.structured.compiler, "max_compile_seconds", 1.0)
    slow = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(.{0,9}){0,9}"}}}
    engine.add_request("slow", "x", constrained(0, json=slow))
    engine.add_request("fine", "y", greedy([8])[0])
    engine.add_request("regex", "z", constrained(0, 12, 0.0, regex="[0-9]{3}"))
    finished = run_engine(engine)
    assert finished["slow"].error_is_bad_request
    assert "too expensive to compile: it took more than 1 s" in finished["slow"].error
    assert finished["fine"].error is None and len(finished["fine"].outputs[0].token_ids) == 8
    assert re.fullmatch("[0-9]{3}", finished["regex"].outputs[0].text)


def test_constraint_params_are_validated():
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(StructuredOutputError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(StructuredOutputError, match="longer than"):
        StructuredOutputsParams(regex="a" * 70_000)
    # nesting: an array schema 950 deep took 62 s to compile, on the pool all requests share
    deep: dict = {"type": "integer", "description": "[[[[ {{ not nesting"}
    for _ in range(63):
        deep = {"type": "array", "items": deep}
    StructuredOutputsParams(json=deep)  # 64 levels
    with pytest.raises(StructuredOutputError, match="nests 65 levels of objects and arrays"):
        StructuredOutputsParams(json=json.dumps({"type": "array", "items": deep}))


class _GatedCompiler:
    """Wraps the engine's compiler: compilations wait for ``gate`` (a slow schema)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self._build = inner._build
        inner._build = self._slow_build

    def _slow_build(self, params):
        assert self.gate.wait(120), "the test never opened the gate"
        return self._build(params)

    def restore(self) -> None:
        self.inner._build = self._build


def test_slow_compilation_holds_back_only_its_request(llm):
    gated = _GatedCompiler(llm.engine.structured.compiler)
    engine = llm.engine
    try:
        slow = {"type": "object", "properties": {"slow": {"type": "integer"}}, "required": ["slow"]}
        engine.add_request(
            "slow", "x", constrained(0, 40, 0.0, json=slow, disable_any_whitespace=True)
        )
        engine.add_request("aborted", "x", constrained(0, 40, 0.0, json={**slow, "title": "a"}))
        engine.add_request("plain", "y", greedy([12])[0])
        engine.abort("aborted")
        finished = {}
        for _ in range(200):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if "plain" in finished:
                break
        assert "plain" in finished and "slow" not in finished
        assert "aborted" not in finished
        gated.gate.set()
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert set(finished) == {"plain", "slow"}
        assert "slow" in json.loads(finished["slow"].outputs[0].text)
    finally:
        gated.gate.set()
        gated.restore()


def test_grammar_end_stops_a_request_that_ignores_eos(llm):
    params = SamplingParams(
        temperature=0, max_tokens=50, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["done"]),
    )  # fmt: skip
    out = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == "done"


@pytest.mark.parametrize("vocab", [49152, 1000, 77])
def test_bitmask_kernel_matches_torch(vocab):
    import torch

    from pagellm.kernels.decode_ops import load_decode_ops
    from pagellm.sampling.sampler import apply_token_bitmask

    ops = load_decode_ops()
    if ops is None:
        pytest.skip("no C++ compiler")
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    for density in (0.0, 0.01, 0.5, 1.0):
        bits = torch.rand(words * 32, generator=gen) < density
        packed = (bits.view(words, 32).long() << torch.arange(32)).sum(dim=1)
        mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        for cut in (words, max(words - 1, 0)):  # a mask shorter than the vocabulary too
            row = torch.randn(vocab, generator=gen)
            want, got = row.clone(), row.clone()
            apply_token_bitmask(want, mask[:cut])
            ops.apply_bitmask(got, mask[:cut])
            assert torch.equal(want, got)
            allowed = bits[: min(cut * 32, vocab)].nonzero().flatten()
            assert torch.equal(want[allowed], row[allowed])
            assert (want == float("-inf")).sum() == vocab - len(allowed)


def test_a_grammar_too_expensive_to_match_fails_alone(llm):
    """An ambiguous grammar's matching grows superlinearly with the output: past the budget
    its request fails, and the other requests of the batch finish as usual."""
    structured = llm.engine.structured
    saved = structured.max_step_seconds
    structured.max_step_seconds = 0.01  # the real bound is 0.25 s; the same check, sooner
    try:
        ambiguous = 'root ::= x+\nx ::= "a" | "a" "a" | x x | "a" x "a"'
        params = [
            # min_tokens: the grammar could end at once; its end (EOS) is banned for a while
            SamplingParams(temperature=0, max_tokens=400, min_tokens=390,
                           structured_outputs=StructuredOutputsParams(grammar=ambiguous)),
            greedy([40])[0],
        ]  # fmt: skip
        engine = llm.engine
        engine.add_request("ambiguous", "x", params[0])
        engine.add_request("plain", "y", params[1])
        finished = run_engine(engine)
        assert "too expensive to match" in finished["ambiguous"].error
        assert "in a trial" not in finished["ambiguous"].error  # the engine's budget, not the
        assert finished["ambiguous"].error_is_bad_request  # worker's trial; a 400
        assert finished["plain"].error is None
        assert len(finished["plain"].outputs[0].token_ids) == 40
    finally:
        structured.max_step_seconds = saved


def test_a_bitmask_that_overruns_is_left_behind_and_fails_its_request_alone(llm):
    """24 digits the compile worker's trial walk finds cheap, then a state whose one fill
    takes seconds: the engine waits for it at most ``fill_timeout``, the request fails as a
    bad request, the thread still filling is left behind, and the request beside it runs on."""
    engine, structured = llm.engine, llm.engine.structured
    before = structured.fills.abandoned
    stall = constrained(0, 40, 0.0, regex="[0-9]{24}((.{0,6}){0,6}){0,6}")
    engine.add_request("stall", "x", stall)
    engine.add_request("plain", "y", greedy([40])[0])
    finished = run_engine(engine)
    assert finished["stall"].error_is_bad_request
    assert "a bitmask took more than 0.25 s" in finished["stall"].error
    assert re.fullmatch("[0-9]{24}", finished["stall"].outputs[0].text)  # then it stopped
    assert structured.fills.abandoned == before + 1
    assert finished["plain"].error is None and len(finished["plain"].outputs[0].token_ids) == 40


def test_copies_past_the_step_budget_get_no_fill(llm, monkeypatch):
    """Once a step's fills of a request's copies pass the step's bound, its other copies are
    not filled (n costly fills would stall the step n times) and the request fails as a bad
    request; a request beside it runs on. The clock moves 1 ms a reading: a fill or an accept
    costs 1 ms; the bound is 2.5 ms a step."""
    structured = llm.engine.structured
    ticks = itertools.count()
    monkeypatch.setattr(structured, "clock", lambda: next(ticks) / 1000)
    monkeypatch.setattr(structured, "max_step_seconds", 0.0025)
    fills = []
    fill = structured._fill_in_budget

    def recorded(seq, proposal):
        rows = fill(seq, proposal)
        if rows is not None:  # None: skipped, past its budget
            fills.append(seq)
        return rows

    monkeypatch.setattr(structured, "_fill_in_budget", recorded)
    engine = llm.engine
    engine.add_request("copies", "x", dataclasses.replace(constrained(0, 20, regex="[a-z]+"), n=4))
    engine.add_request("plain", "y", greedy([6])[0])
    finished = run_engine(engine)
    # step 1: the shared prompt's one row (fill + accept: 2 ms); step 2: three fills reach
    # 3 ms, the fourth copy gets none
    assert fills == ["copies#0", "copies#0", "copies#1", "copies#2"]
    assert finished["copies"].error_is_bad_request
    assert "too expensive to match: one step took" in finished["copies"].error
    assert finished["plain"].error is None


def test_a_requests_copies_share_its_matching_budget(llm):
    """n copies of one grammar cost the engine thread n times one: the step and total bounds
    hold for the request (a clock that moves 1 ms a reading: each call costs 1 ms)."""
    from fakes import FakeClock

    from pagellm.structured.grammar import StructuredOutputManager

    manager = StructuredOutputManager(
        llm.engine.structured.compiler, max_step_seconds=0.005, max_seconds=0.05,
        clock=FakeClock(0.001),
    )  # fmt: skip
    params = StructuredOutputsParams(regex="a+")
    copies = [f"four-{i}" for i in range(4)]
    manager.compiler.compile_now(params)  # cached: the starts below find it compiled
    manager.start(["one"], params)
    manager.start(copies, params)
    for seq in ["one", *copies]:
        assert manager.ready(seq)
    (a,) = llm.tokenizer.encode("a", add_special_tokens=False)

    def step(seqs):
        manager.new_step()
        rows = manager.bitmasks([(seq, []) for seq in seqs])
        for seq in seqs:
            if rows[seq] is not None:  # None: past its budget before the step, not filled
                assert manager.accept(seq, [a])
        return rows

    assert None not in step(["one", *copies]).values()
    assert manager.over_budget("one") is None  # 2 ms a step
    for seq in copies:  # 4 x 2 ms in one step
        assert "one step took 0.01 s (at most 0.005 s" in manager.over_budget(seq)
    assert step(copies) == dict.fromkeys(copies)  # past the budget: no more fills
    for _ in range(20):
        assert step(["one"])["one"] is not None
    assert manager.over_budget("one") is None  # 42 ms in all
    for _ in range(5):
        step(["one"])
    assert "0.1 s in all (at most 0.05 s)" in manager.over_budget("one")
    assert step(["one"]) == {"one": None}
    manager.fills.close()  # not shutdown(): the compiler is the module's engine's


def test_grammar_cache_is_bounded_by_bytes(llm):
    from pagellm.structured.grammar import GrammarCompiler

    compiled = []
    compiler = GrammarCompiler(
        llm.tokenizer.hf, llm.engine.vocab_size, [llm.tokenizer.eos_token_id],
        cache_bytes=1, on_compiled=compiled.append,
    )  # fmt: skip
    first, second = StructuredOutputsParams(regex="a+"), StructuredOutputsParams(regex="b+")
    compiler.compile_now(first)
    compiler.compile_now(first)
    assert len(compiled) == 1  # a cache hit
    compiler.compile_now(second)  # over the bytes: the least recently used one goes
    compiler.compile_now(first)
    assert len(compiled) == 3
    compiler.shutdown()


def test_settings_that_leave_the_grammar_no_token_fail_alone_as_bad_requests(llm):
    """The sampler leaves no token the grammar admits (min_tokens past the grammar's end,
    allowed_token_ids outside it) or the grammar admits nothing: the request ends with a
    client error saying which; a request beside it runs on."""
    engine = llm.engine
    cases = {
        "min": (SamplingParams(max_tokens=10, min_tokens=8, n=2, temperature=0,
                               structured_outputs=StructuredOutputsParams(choice=["a"])),
                "min_tokens=8"),
        "allowed": (SamplingParams(max_tokens=5, temperature=0, allowed_token_ids=[0],
                                   structured_outputs=StructuredOutputsParams(choice=["yes"])),
                    "allowed_token_ids"),
        "empty": (constrained(0, regex=r"[^\s\S]"), "admits no output"),
    }  # fmt: skip
    rejected = {}
    for rid, (params, _) in cases.items():
        try:
            engine.add_request(rid, "x", params)
        except RequestRejected as exc:  # compiled at once (a cached grammar): refused at once
            rejected[rid] = str(exc)
    engine.add_request("fine", "y", greedy([8])[0])
    finished = run_engine(engine)
    for rid, (_, match) in cases.items():
        if rid in rejected:
            assert match in rejected[rid]
            continue
        assert finished[rid].error_is_bad_request, finished[rid].error
        assert match in finished[rid].error
    if "allowed" in finished:  # the token the grammar refused is not output
        assert finished["allowed"].outputs[0].token_ids == []
    for rid in cases.keys() & finished.keys():  # ids and text agree: the last step's are gone
        for o in finished[rid].outputs:
            assert engine.tokenizer.decode(o.token_ids) == o.text
    assert finished["fine"].error is None
    assert len(finished["fine"].outputs[0].token_ids) == 8
    assert not engine.has_unfinished_requests()
    # the empty language's grammar is cached now: the same constraint is refused at once
    with pytest.raises(RequestRejected, match="admits no output"):
        engine.add_request("empty-again", "x", constrained(0, regex=r"[^\s\S]"))
    assert not engine.has_unfinished_requests()


def test_remote_refs_are_refused_and_tool_refs_resolve_inside_their_tool(llm):
    from pagellm.structured.tools import tool_constraint

    compiler = llm.engine.structured.compiler
    with pytest.raises(StructuredOutputError, match="not local"):
        compiler.compile_now(StructuredOutputsParams(json={"$ref": "http://127.0.0.1:1/x.json"}))
    city = {
        "$defs": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "type": "object",
        "properties": {"c": {"$ref": "#/$defs/city"}},
        "required": ["c"],
    }
    tools = [
        {"name": "other", "parameters": {"type": "object"}},
        {"name": "loc", "parameters": city},
    ]
    required = tool_constraint(tools, "required")
    assert compiler.compile_now(required) is not None  # "#/$defs/city" found in its tool
    only_loc = tool_constraint(tools[1:], "required", parallel_tool_calls=False)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=only_loc)
        for i in range(8)
    ]
    outs = [o.outputs[0] for o in llm.generate(["x"] * 8, params, use_tqdm=False)]
    calls = [json.loads(o.text)[0] for o in outs if o.finish_reason == "stop"]
    assert calls, [o.text[:80] for o in outs]
    assert all(c["name"] == "loc" and c["parameters"]["c"] in ("Paris", "Rome") for c in calls)
    deep = {"type": "object"}
    for _ in range(2000):  # a tool whose rewriting would pass Python's recursion limit
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(StructuredOutputError, match="nested too deeply"):
        tool_constraint([{"name": "d", "parameters": deep}], "required")
    # "#" is the tool's own schema, not the wrapper: a self-reference is circular everywhere
    selfref = [{"name": "f", "parameters": {"$ref": "#"}}]
    for constraint in (
        tool_constraint(selfref, "required"),
        tool_constraint(selfref, {"name": "f"}),
    ):
        with pytest.raises(StructuredOutputError, match="Circular"):
            compiler.compile_now(constraint)
