"""Verifying proposed tokens (speculative decoding) so the output keeps the target's law.

Standard speculative sampling (Leviathan et al.; Chen et al.): a proposal d_j drawn from the
draft's q_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the
token is drawn from norm(max(0, p_j - q_j)) instead and the rest are dropped; when every proposal
is accepted a bonus token is drawn from p_{k}. Each emitted token is then distributed exactly as
if drawn from the target alone. Proposals that are not sampled (n-gram lookup) have a one-hot
q: accept with probability p_j(d_j), else draw from p_j with d_j removed. Greedy: accept while the
target's argmax equals the proposal, then emit the argmax.
"""

from __future__ import annotations

import torch


def accept_greedy(proposal: list[int], argmax: list[int]) -> list[int]:
    """``argmax[j]``: the target's choice at proposal position j (``len(proposal) + 1`` of
    them). The accepted proposals and the target's token after them."""
    out: list[int] = []
    for j, token in enumerate(proposal):
        if argmax[j] != token:
            break
        out.append(token)
    out.append(argmax[len(out)])
    return out


def rejection_sample(
    target_probs: torch.Tensor,
    proposal: list[int],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """``target_probs`` [k + 1, vocab] (rows sum to 1); ``draft_probs`` [k, vocab] or None
    for deterministic proposals. Returns the accepted proposals and one more token."""
    out: list[int] = []
    for j, token in enumerate(proposal):
        p = target_probs[j]
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * q_token < float(p[token]):
            out.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p <= q everywhere up to rounding: p itself
            residual = p
        out.append(draw(residual, generator))
        return out
    out.append(draw(target_probs[len(proposal)], generator))
    return out


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn with probability proportional to ``weights`` (not normalized)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int(torch.argmax(weights / noise))
