"""Scheduling policies (fake runner, milliseconds): priority order and priority preemption, the
priority check under other policies, fairness between two tenants, and the thrash guard."""

from __future__ import annotations

import pytest
from fakes import make_engine, run_to_completion

from pagellm.engine.errors import RequestRejected
from pagellm.engine.policy import make_policy
from pagellm.engine.sampling_params import SamplingParams


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _first_token_steps(engine, runner) -> dict[str, int]:
    """Request id -> the step at which it got its first token (a step index)."""
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, step)
        step += 1
    return first


def test_priority_orders_the_waiting_queue():
    engine, runner = make_engine(max_num_seqs=1, policy="priority")
    for rid, prio in (("low", 9), ("mid", 5), ("high", 1)):
        engine.add_request(rid, [1, 2, 3], _greedy(2), priority=prio)
    run_to_completion(engine)
    order = [s.scheduled[0].request_id for s in runner.steps if s.scheduled]
    firsts = [order.index(r) for r in ("high", "mid", "low")]
    assert firsts == sorted(firsts)


def test_important_arrival_preempts_a_running_request():
    engine, runner = make_engine(max_num_seqs=1, policy="priority")
    engine.add_request("bulk", [1, 2, 3], _greedy(30), priority=5)
    for _ in range(3):
        engine.step()
    engine.add_request("vip", [4, 5, 6], _greedy(3), priority=0)
    engine.step()
    assert [s.request_id for s in runner.steps[-1].scheduled] == ["vip"]
    assert runner.steps[-1].preempted_request_ids == ["bulk"]
    done = run_to_completion(engine)
    assert done["bulk"].outputs[0].token_ids == list(range(4, 34))  # resumed, nothing lost


def test_equal_priority_does_not_preempt():
    engine, runner = make_engine(max_num_seqs=1, policy="priority")
    engine.add_request("first", [1, 2, 3], _greedy(10), priority=3)
    engine.step()
    engine.add_request("second", [4, 5, 6], _greedy(2), priority=3)
    run_to_completion(engine)
    assert engine.stats.num_preemptions == 0


def test_priority_needs_the_priority_policy():
    for policy in ("fcfs", "fair"):
        engine, _ = make_engine(policy=policy)
        with pytest.raises(RequestRejected, match="--scheduling-policy priority"):
            engine.add_request("a", [1, 2], _greedy(2), priority=1)
        engine.add_request("b", [1, 2], _greedy(2), priority=0)  # the default is fine


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown scheduling policy 'lottery'"):
        make_policy("lottery")


def _flood_then_quiet(policy: str) -> dict[str, int]:
    engine, runner = make_engine(
        num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, policy=policy
    )
    for i in range(16):  # the flooding tenant: long prompts, long answers, all at once
        engine.add_request(f"flood{i}", list(range(10, 70)), _greedy(24), tenant="flood")
    for _ in range(3):
        engine.step()
    for i in range(3):  # then a quiet tenant's short requests
        engine.add_request(f"quiet{i}", [5, 6, 7], _greedy(4), tenant="quiet")
    return _first_token_steps(engine, runner)


def test_fair_policy_bounds_the_quiet_tenants_wait():
    fcfs = _flood_then_quiet("fcfs")
    fair = _flood_then_quiet("fair")
    quiet_fcfs = max(fcfs[f"quiet{i}"] for i in range(3))
    quiet_fair = max(fair[f"quiet{i}"] for i in range(3))
    # under fcfs the quiet tenant waits behind the whole flood (16 requests, 4 at a time);
    # fairly it takes the first slot that frees up: at most one flood request's 24 decode
    # steps after it arrived (after step 3), whatever the size of the flood
    assert quiet_fair <= 3 + 24 + 2
    assert quiet_fcfs > 3 * quiet_fair


def test_fair_counters_start_level_and_are_forgotten_when_idle():
    engine, _ = make_engine(policy="fair")
    policy = engine.scheduler.policy
    engine.add_request("a", list(range(10, 40)), _greedy(5), tenant="a")
    for _ in range(3):
        engine.step()
    served_a = policy.counters["a"]
    assert served_a > 0
    engine.add_request("b", [1, 2], _greedy(2), tenant="b")
    assert policy.counters["b"] == served_a  # no credit for having been away
    run_to_completion(engine)
    assert policy.counters == {}


def _thrash(protect_after: int):
    # found by a seeded search: without the guard "long" (the latest arrival, so the usual
    # victim) is admitted as soon as blocks free up and preempted again as the others grow
    engine, _ = make_engine(
        num_blocks=13, block_size=4, max_num_batched_tokens=64, max_model_len=52,
        protect_after=protect_after,
    )  # fmt: skip
    for rid, prompt_len, out in (("r0", 8, 22), ("r1", 7, 18), ("r2", 8, 4), ("long", 21, 12)):
        engine.add_request(rid, list(range(10, 10 + prompt_len)), _greedy(out))
    return run_to_completion(engine)


def test_thrash_guard_spares_a_request_preempted_repeatedly():
    unguarded = _thrash(protect_after=1000)
    assert unguarded["long"].metrics.num_preemptions >= 3
    guarded = _thrash(protect_after=2)
    assert guarded["long"].metrics.num_preemptions == 2
    assert sum(guarded[r].metrics.num_preemptions for r in ("r0", "r1", "r2")) > 0
    for done in (unguarded, guarded):  # outputs are never lost: t -> t + 1
        assert done["long"].outputs[0].token_ids == list(range(31, 43))
