"""Sampling: grammar bitmasks, penalties, logit bias, allowed tokens, min_tokens, greedy /
temperature / top-k / top-p / min-p, logprobs.

Each request owns a ``torch.Generator`` seeded from its seed, and random numbers are drawn per
request, so a seeded request gets the same tokens whatever else is in the batch.
Logprobs are those of the model's raw distribution (before penalties and temperature).

A fault while sampling for one request costs that request alone: the batch is sampled again row
by row, and a row that still raises is reported in ``SampleResult.failed`` instead of a token.

A request with proposed tokens (speculative decoding) has one row per proposal plus one; each row
is shaped as if the proposals before it were already output (penalties, min_tokens), and the
proposals are verified (``rejection.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagellm.engine.outputs import ScheduledRequest, TokenLogprobs
from pagellm.sampling.rejection import accept_greedy, rejection_sample


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    failed: dict[int, str] = field(default_factory=dict)
    """Row -> why sampling for it raised (its token in ``token_ids`` is meaningless)."""


@dataclass(slots=True)
class StepSamples:
    """Per request of a step: its new tokens (one, or accepted proposals and one more) and
    their logprobs (empty unless asked for)."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]]
    failed: dict[int, str] = field(default_factory=dict)
    """Request index -> why sampling for it raised (its tokens are meaningless)."""


class Sampler:
    def __init__(
        self,
        argmax: Callable[[torch.Tensor], list[int]] | None = None,
        apply_bitmask: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """``argmax``: ``logits.argmax(dim=-1).tolist()`` done faster (the CPU decode ops'
        kernel); torch's otherwise. ``apply_bitmask``: ``apply_token_bitmask`` done faster."""
        self._argmax = argmax
        self._apply_bitmask = apply_bitmask or apply_token_bitmask
        self._generators: dict[str, torch.Generator] = {}
        self._shaping: dict[str, _Shaping] = {}
        """Request id -> its logit bias and allowed-token tensors, built once per request."""

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._shaping.pop(rid, None)

    def sample_step(
        self,
        logits: torch.Tensor,
        reqs: list[ScheduledRequest],
        draft_probs: dict[str, torch.Tensor | None] | None = None,
    ) -> StepSamples:
        """``logits`` has ``1 + len(r.spec_token_ids)`` consecutive rows for each request;
        ``draft_probs``: the distributions a draft model drew a request's proposals from (none:
        the proposals were not sampled, as n-gram lookups)."""
        draft_probs = draft_probs or {}
        counts = [1 + len(r.spec_token_ids) for r in reqs]
        plain = [i for i, c in enumerate(counts) if c == 1]
        out = StepSamples([[] for _ in reqs], [[] for _ in reqs])
        if len(plain) == len(reqs):
            self._fill_plain(out, logits, reqs, plain)
            return out
        starts = [sum(counts[:i]) for i in range(len(reqs))]
        if plain:
            rows = torch.tensor([starts[i] for i in plain], device=logits.device)
            self._fill_plain(out, logits.index_select(0, rows), reqs, plain)
        spec = [i for i, c in enumerate(counts) if c > 1]
        simple = [i for i in spec if _is_simple(reqs[i])]
        if simple:
            rows = torch.tensor(
                [r for i in simple for r in range(starts[i], starts[i] + counts[i])],
                device=logits.device,
            )
            choices = logits.index_select(0, rows).float().argmax(dim=-1).tolist()
            at = 0
            for i in simple:
                out.token_ids[i] = accept_greedy(reqs[i].spec_token_ids, choices[at:])
                at += counts[i]
        for i in spec:
            if i in simple:
                continue
            try:
                rows = logits[starts[i] : starts[i] + counts[i]]
                q = draft_probs.get(reqs[i].request_id)
                out.token_ids[i], out.logprobs[i] = self._verify(rows, reqs[i], q)
            except Exception as exc:  # noqa: BLE001 - reported as that request's failure
                out.failed[i] = f"sampling failed: {type(exc).__name__}: {exc}"
                self.forget([reqs[i].request_id])
        return out

    def _fill_plain(
        self, out: StepSamples, logits: torch.Tensor, reqs: list[ScheduledRequest], idx: list[int]
    ) -> None:
        result = self.sample(logits, [reqs[i] for i in idx])
        for j, i in enumerate(idx):
            out.token_ids[i] = [result.token_ids[j]]
            lp = result.logprobs[j]
            out.logprobs[i] = [lp] if lp is not None else []
            if j in result.failed:
                out.failed[i] = result.failed[j]

    def _verify(
        self, logits: torch.Tensor, req: ScheduledRequest, draft_probs: torch.Tensor | None
    ) -> tuple[list[int], list[TokenLogprobs]]:
        """One request's proposals against its rows: each row shaped as if the proposals
        before it were output already."""
        proposal = req.spec_token_ids
        raw = logits.float().cpu()
        views = [
            dataclasses.replace(req, output_token_ids=req.output_token_ids + proposal[:j])
            for j in range(len(proposal) + 1)
        ]
        shaped = raw.clone()
        shaping = self._shaping_of(req)
        for j, view in enumerate(views):
            if req.token_bitmask is not None:
                self._apply_bitmask(shaped[j], req.token_bitmask[j])
            _shape_logits(shaped[j], view, shaping)
        if req.params.greedy:
            tokens = accept_greedy(proposal, shaped.argmax(dim=-1).tolist())
        else:
            probs = sampling_probs(shaped, views)
            probs /= probs.sum(dim=-1, keepdim=True)  # min-p zeroed some: p_j must sum to 1
            tokens = rejection_sample(probs, proposal, self.generator(req), draft_probs)
        if req.params.logprobs is None:
            return tokens, []
        lps = _logprobs(raw[: len(tokens)], tokens, views[: len(tokens)])
        return tokens, [lp for lp in lps if lp is not None]

    def sample(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> SampleResult:
        """``logits`` [len(reqs), vocab] in the model's dtype; row i belongs to ``reqs[i]``.

        A pure greedy batch takes the argmax of the logits widened to float32 (exact, and
        torch's float32 argmax is ~2x faster on CPU than its bf16 one); everything else works
        in float32 on the host (per-request generators are CPU ones, so a seed gives the same
        tokens on every device).
        """
        if all(_is_simple(r) for r in reqs):
            return SampleResult(self._greedy(logits), [None] * len(reqs))
        if all(_is_masked_greedy(r) for r in reqs):
            masked = logits.to(torch.float32, copy=True)
            for i, req in enumerate(reqs):
                if req.token_bitmask is not None:
                    self._apply_bitmask(masked[i], req.token_bitmask[0])
            return SampleResult(self._greedy(masked), [None] * len(reqs))
        raw = logits.float().cpu()
        try:
            return self._sample_rows(raw, reqs)
        except Exception:  # noqa: BLE001 - find the row at fault; the others still sample
            return self._sample_each(raw, reqs)

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        if self._argmax is not None:
            return self._argmax(logits)
        return logits.float().argmax(dim=-1).tolist()

    def _sample_rows(self, raw: torch.Tensor, reqs: list[ScheduledRequest]) -> SampleResult:
        logits = raw.clone()
        for i, req in enumerate(reqs):
            if req.token_bitmask is not None:
                self._apply_bitmask(logits[i], req.token_bitmask[0])
            _shape_logits(logits[i], req, self._shaping_of(req))
        tokens = self._choose(logits, reqs)
        return SampleResult(tokens, _logprobs(raw, tokens, reqs))

    def _sample_each(self, raw: torch.Tensor, reqs: list[ScheduledRequest]) -> SampleResult:
        """One row at a time; a row that raises fails its request alone."""
        result = SampleResult([0] * len(reqs), [None] * len(reqs))
        for i, req in enumerate(reqs):
            try:
                one = self._sample_rows(raw[i : i + 1], [req])
            except Exception as exc:  # noqa: BLE001 - reported as that request's failure
                result.failed[i] = f"sampling failed: {type(exc).__name__}: {exc}"
                self.forget([req.request_id])
                continue
            result.token_ids[i], result.logprobs[i] = one.token_ids[0], one.logprobs[0]
        return result

    def _choose(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not rows:
            return tokens
        probs = sampling_probs(logits[rows], [reqs[i] for i in rows])
        for j, i in enumerate(rows):
            noise = torch.empty_like(probs[j]).exponential_(generator=self.generator(reqs[i]))
            tokens[i] = int(torch.argmax(probs[j] / noise))
        return tokens

    def _shaping_of(self, req: ScheduledRequest) -> _Shaping | None:
        if not req.params.shapes_logits:
            return None
        shaping = self._shaping.get(req.request_id)
        if shaping is None:
            shaping = self._shaping[req.request_id] = _shaping(req)
        return shaping

    def generator(self, req: ScheduledRequest) -> torch.Generator:
        """The request's own random stream (seeded from its seed on first use)."""
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(generator_seed(req.seed))
            self._generators[req.request_id] = gen
        return gen


def generator_seed(seed: int) -> int:
    """What a request's seed (an int64, or its uint64 form) seeds torch's CPU generator with.
    That generator keeps only a seed's low 32 bits, so seeds that differ only above them (-1
    and 2**63 - 1; 5 and 2**32 + 5) drew the same stream; the high half is hashed into the low
    one. Seeds below 2**32 are kept as they are."""
    if not -(1 << 63) <= seed < 1 << 64:
        raise ValueError(f"seed {seed} is outside int64 / uint64")
    seed &= (1 << 64) - 1
    high = seed >> 32
    return (seed ^ (high * 0x9E3779B1)) & 0xFFFFFFFF


def _is_simple(req: ScheduledRequest) -> bool:
    """Greedy on the raw logits: an argmax decides, nothing shapes them first."""
    return _is_masked_greedy(req) and req.params.structured_outputs is None


def _is_masked_greedy(req: ScheduledRequest) -> bool:
    """Greedy on the logits with at most a grammar's bitmask applied."""
    p = req.params
    return (
        p.greedy
        and not p.needs_penalties
        and not p.logit_bias
        and p.allowed_token_ids is None
        and p.logprobs is None
        and len(req.output_token_ids) >= p.min_tokens
    )


def sampling_probs(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> torch.Tensor:
    """Sampling distributions of shaped rows: temperature, top-k / top-p, then min-p."""
    temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)
    sub = logits / temps.unsqueeze(1)
    _filter_top_k_top_p(sub, reqs)
    probs = torch.softmax(sub, dim=-1)
    _filter_min_p(probs, reqs)
    return probs


@dataclass(slots=True)
class _Shaping:
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed: torch.Tensor | None


def _shaping(req: ScheduledRequest) -> _Shaping:
    bias, allowed = req.params.logit_bias, req.params.allowed_token_ids
    return _Shaping(
        torch.tensor(list(bias), dtype=torch.long) if bias else None,
        torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None,
        torch.tensor(sorted(set(allowed)), dtype=torch.long) if allowed is not None else None,
    )


def _shape_logits(row: torch.Tensor, req: ScheduledRequest, shaping: _Shaping | None) -> None:
    """Everything that changes one request's logits before choosing, in vLLM's order (a
    grammar's bitmask comes before, as vLLM applies it to the logits before its sampler)."""
    _apply_penalties(row, req)
    if shaping is not None:
        _apply_bias_and_allowed(row, shaping)
    _apply_min_tokens(row, req)


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def bitmask_allowed(bitmask: torch.Tensor, size: int) -> torch.Tensor:
    """Which of ``size`` tokens a bitmask row allows, as bools (bit ``t % 32`` of int32 word
    ``t // 32``, as xgrammar packs it); tokens past the bitmask's words are not allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS.to(bitmask.device)) & 1
    allowed = bits.view(-1)[:size].bool()
    if allowed.shape[0] < size:
        allowed = torch.cat([allowed, allowed.new_zeros(size - allowed.shape[0])])
    return allowed


def apply_token_bitmask(row: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf on every token the bitmask row does not allow (``bitmask_allowed``)."""
    row.masked_fill_(~bitmask_allowed(bitmask.to(row.device), row.shape[0]), float("-inf"))


def _apply_bias_and_allowed(row: torch.Tensor, shaping: _Shaping) -> None:
    if shaping.bias_ids is not None:
        row.index_add_(0, shaping.bias_ids, shaping.bias_values.to(row.dtype))
    if shaping.allowed is not None:
        keep = torch.full_like(row, float("-inf"))
        keep[shaping.allowed] = row[shaping.allowed]
        row.copy_(keep)


def _apply_penalties(row: torch.Tensor, req: ScheduledRequest) -> None:
    p = req.params
    if not p.needs_penalties:
        return
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)))
        vals = row[seen]
        penalized = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        # a tiny (valid) penalty can overflow: keep the row finite, orderable and softmax-able
        row[seen] = penalized.clamp_(max=torch.finfo(row.dtype).max)
    if req.output_token_ids and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=row.shape[0])
        counts = counts[: row.shape[0]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _apply_min_tokens(row: torch.Tensor, req: ScheduledRequest) -> None:
    if len(req.output_token_ids) >= req.params.min_tokens:
        return
    banned = list(req.params.stop_token_ids)
    if req.eos_token_id is not None:
        banned.append(req.eos_token_id)
    if banned:
        row[torch.tensor(banned)] = float("-inf")


def _filter_top_k_top_p(logits: torch.Tensor, reqs: list[ScheduledRequest]) -> None:
    vocab = logits.shape[-1]
    ks = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in reqs]
    ps = [r.params.top_p for r in reqs]
    if all(k >= vocab for k in ks) and all(p >= 1.0 for p in ps):
        return
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= torch.tensor(ks).unsqueeze(1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= torch.tensor(ps, dtype=probs.dtype).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def _filter_min_p(probs: torch.Tensor, reqs: list[ScheduledRequest]) -> None:
    min_ps = [r.params.min_p for r in reqs]
    if not any(min_ps):
        return
    threshold = torch.tensor(min_ps, dtype=probs.dtype).unsqueeze(1) * probs.max(
        dim=-1
    ).values.unsqueeze(1)
    probs.masked_fill_(probs < threshold, 0.0)


def _logprobs(
    raw: torch.Tensor, tokens: list[int], reqs: list[ScheduledRequest]
) -> list[TokenLogprobs | None]:
    rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(reqs)
    if not rows:
        return result
    lp = torch.log_softmax(raw[rows], dim=-1)
    for j, i in enumerate(rows):
        n = min(reqs[i].params.logprobs or 0, lp.shape[-1])
        top_vals, top_ids = (
            lp[j].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        )
        top = list(zip(top_ids.tolist(), top_vals.tolist(), strict=True))
        result[i] = TokenLogprobs(tokens[i], float(lp[j, tokens[i]]), top)
    return result
