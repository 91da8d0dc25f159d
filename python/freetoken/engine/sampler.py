"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2020), per-request seeds."""

from __future__ import annotations

import torch

from freetoken.engine.types import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [N, V] float32 logits on the compute device.
        params: N sampling parameter sets, row by row.
        generators: N RNGs on the logits' device (None for greedy rows).

    Returns:
        N token ids.
    """
    greedy = torch.argmax(logits, dim=-1).tolist()
    out: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            out.append(greedy[row])
            continue
        scores = logits[row] / p.temperature
        if p.top_k > 0 and p.top_k < scores.numel():
            # Keep exactly top_k ids (by index, not `>= k-th value`: ties, common in bf16 logits, would keep more).
            keep = torch.topk(scores, p.top_k).indices
            scores = torch.full_like(scores, float("-inf")).scatter(0, keep, scores[keep])
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token when the mass before it already reaches top_p; the first token always stays.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out
