"""The draft model of speculative decoding (``method: draft_model``): a smaller model that
shares the target's tokenizer, proposes k tokens per step, and keeps its own paged KV cache.

Its cache has the target's blocks, one for one: the same block ids and block size, its own
tensors, so the scheduler's block tables, prefix cache, preemption and swapping serve both
(swaps copy both caches). Which positions of a sequence hold valid draft KV is tracked here
(``_done``): a step first catches the draft up from there to the sequence's last token (after a
prefill, a preemption or a prefix-cache hit that is the context so far; otherwise one or two
tokens; a preempted request starts again from its first position), then runs one single-token
pass per further proposal. Proposals are sampled from the
draft's distribution ``q`` (greedy requests: its argmax), and ``q`` goes to the verifier, which
keeps the target's law whatever the draft says: draft KV that is stale costs acceptance, never
correctness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.engine.outputs import ScheduledRequest
from pagellm.sampling.rejection import draw
from pagellm.sampling.sampler import Sampler, sampling_probs


@dataclass(slots=True)
class Proposals:
    """Per speculating request: its proposed tokens and the draft's distribution for each
    (None for greedy requests, whose proposals are the draft's argmax)."""

    tokens: dict[str, list[int]]
    probs: dict[str, torch.Tensor | None]


class DraftModel:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: TorchAttentionBackend,
        num_layers: int,
        num_blocks: int,
        num_host_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.num_blocks = num_blocks
        self.device = device
        self.kv_caches = backend.allocate_cache(num_layers, num_blocks)
        self.host_caches = backend.allocate_cache(num_layers, num_host_blocks, host=True)
        self._done: dict[str, int] = {}
        """Request id -> positions 0.._done-1 hold valid draft KV."""

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._done.pop(rid, None)

    def propose(self, reqs: list[ScheduledRequest], sampler: Sampler) -> Proposals:
        """Up to ``num_draft_slots`` tokens for each of ``reqs`` (decoding requests: one token
        each in ``token_ids``, the last sampled one)."""
        from pagellm.runner.model_runner import prepare_inputs

        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in reqs}
        current = [self._catch_up(r) for r in reqs]
        for step in range(max(r.num_draft_slots for r in reqs)):
            live = [(r, c) for r, c in zip(reqs, current, strict=True) if step < r.num_draft_slots]
            inputs = prepare_inputs([c for _, c in live], self.backend.is_row_wise, self.device)
            meta = self.backend.build_metadata(inputs.layouts, self.num_blocks)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
            rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float().cpu()
            by_id = {s.request_id: i for i, s in enumerate(inputs.sample_reqs)}
            for req, _ in live:
                row = logits[by_id[req.request_id]]
                token, q = self._choose(row, req, sampler)
                tokens[req.request_id].append(token)
                if q is not None:
                    probs[req.request_id].append(q)
            self._done.update({c.request_id: c.start_pos + c.num_tokens for _, c in live})
            current = [
                dataclasses.replace(
                    c, token_ids=[tokens[c.request_id][-1]], start_pos=c.start_pos + c.num_tokens
                )
                for c in current
            ]
        return Proposals(tokens, {rid: torch.stack(p) if p else None for rid, p in probs.items()})

    def _catch_up(self, req: ScheduledRequest) -> ScheduledRequest:
        """The request's first draft chunk: from its first position without draft KV to its
        last token (the target recomputes from ``start_pos`` after a preemption: so does the
        draft)."""
        done = min(self._done.get(req.request_id, 0), req.start_pos)
        context = req.prompt_token_ids + req.output_token_ids
        return dataclasses.replace(
            req, token_ids=context[done : req.start_pos] + req.token_ids, start_pos=done
        )

    @staticmethod
    def _choose(
        row: torch.Tensor, req: ScheduledRequest, sampler: Sampler
    ) -> tuple[int, torch.Tensor | None]:
        if req.params.greedy:
            return int(row.argmax()), None
        q = sampling_probs(row.unsqueeze(0), [req])[0]
        q /= q.sum()
        return draw(q, sampler.generator(req)), q

    def verified(self, req: ScheduledRequest, num_proposed: int, num_accepted: int) -> None:
        """After verification: the draft wrote the last token and the first
        ``num_proposed - 1`` proposals; those past the accepted ones are stale."""
        valid = req.start_pos + 1 + min(num_accepted, num_proposed - 1)
        self._done[req.request_id] = min(self._done.get(req.request_id, 0), valid)
