"""Greedy reference from Hugging Face transformers, and a comparison that tolerates only ties.

Batching changes the order of floating-point sums, so where the reference's top two logits are
closer than ``TIE_TOLERANCE`` the two engines may pick different tokens. A divergence is accepted
only at such a near-tie, detected from the reference's own logits; the rest of that sequence is
then not compared (it continues from a different token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_TOLERANCE = 1e-4


@dataclass
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]


def load_default_hf(dtype: torch.dtype = torch.float32):
    """transformers' own model for the embedded default GGUF (its own GGUF loader)."""
    import transformers

    from pagellm.fetch import require_default_model

    path = require_default_model()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return Reference(tokens, [step[0].float() for step in out.logits])


@dataclass
class Comparison:
    exact: bool
    near_tie_at: int | None


def compare_greedy(ours: list[int], ref: Reference, label: str = "") -> Comparison:
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens vs {len(ref.tokens)}"
    for pos, (a, b) in enumerate(zip(ours, ref.tokens, strict=True)):
        if a == b:
            continue
        logits = ref.logits[pos]
        gap = float(logits[b] - logits[a])
        assert gap < TIE_TOLERANCE, (
            f"{label}: token {pos} differs ({a} vs reference {b}) and it is no near-tie "
            f"(logit gap {gap:.3g})"
        )
        print(f"{label}: accepted divergence at token {pos}, near-tie gap {gap:.2e}")
        return Comparison(False, pos)
    return Comparison(True, None)
