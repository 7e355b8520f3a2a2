"""A scripted fake runner and tokenizer: engine tests without a model (milliseconds)."""

from __future__ import annotations

from pagellm.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RunnerOutput, SchedulerOutput


class FakeRunner:
    """Samples ``(last token + 1) % vocab`` for every request that samples (verifying proposed
    tokens against that rule); records schedules."""

    def __init__(self, num_blocks: int, vocab: int = 1000, num_host_blocks: int = 0) -> None:
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.vocab = vocab
        self.steps: list[SchedulerOutput] = []

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append(sched)
        return RunnerOutput({s.request_id: self._tokens(s) for s in sched.scheduled if s.sample})

    def _tokens(self, s) -> list[int]:
        """The next token; with proposals, those that match the model's own choice and then
        its choice after them (greedy verification)."""
        last = s.token_ids[-1 - len(s.spec_token_ids)]
        out = []
        for proposed in s.spec_token_ids:
            if proposed != (last + 1) % self.vocab:
                break
            out.append(proposed)
            last = proposed
        return [*out, (last + 1) % self.vocab]


class FakeTokenizer:
    """Token t is the text ``"<t>"``; token 2 is EOS."""

    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{t}>" for t in token_ids)


class FakeClock:
    """A clock tests move by hand (``now``); each reading also advances it by ``step``."""

    def __init__(self, step: float = 0.001) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def make_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 128,
    chunked: bool = True,
    prefix_caching: bool = True,
    policy: str = "fcfs",
    protect_after: int = 2,
    preemption_mode: str = "recompute",
    num_host_blocks: int = 0,
    attention_crossover: float | None = None,
    speculative_config: str | dict | None = None,
    runner: FakeRunner | None = None,
    **scheduler_extra: object,
) -> tuple[LLMEngine, FakeRunner]:
    config = EngineConfig(
        ModelConfig(),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        SchedulerConfig(
            max_num_seqs,
            max_num_batched_tokens,
            chunked,
            scheduling_policy=policy,
            preemption_protect_after=protect_after,
            preemption_mode=preemption_mode,
            **scheduler_extra,
        ),
        speculative=SpeculativeConfig(speculative_config=speculative_config),
    )
    runner = runner or FakeRunner(num_blocks, num_host_blocks=num_host_blocks)
    engine = LLMEngine(
        config,
        runner,
        FakeTokenizer(),
        max_model_len,
        1000,
        clock=FakeClock(),
        attention_crossover=attention_crossover,
    )
    return engine, runner


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("engine did not finish")


class RowSpy:
    """Stands in for a few-rows linear kernel (same ``max_rows`` and ``applies``) and records the
    row count of every call it computes, passing it on to the real kernel."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.max_rows = kernel.max_rows
        self.applies = kernel.applies
        self.rows: list[int] = []

    def __call__(self, *args):
        self.rows.append(args[0].shape[0])
        return self.kernel(*args)
