"""The routed-expert computation over stacked weights, shared by every backend: by expert id (`fused`) or by
cache slot id (`offload`, `hybrid`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Devices whose tensors take the Triton grouped kernel (`freetoken.kernels.fused_moe`); elsewhere one SwiGLU per
# expert in torch. Tests add "cpu" (Triton's interpreter) or "meta" (`tests/activation_peak.py`).
KERNEL_DEVICES = {"cuda"}


def expert_views(experts: torch.Tensor, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of packed experts as the stacked weights `grouped_swiglu` takes, without a copy.

    Args:
        experts: [E, stride] uint8, one expert per row in the pool's layout {gate_up [2I, H], down [H, I], padding}
            of bf16 (`freetoken._core.ExpertPool`, `expert_stride` bytes apart), on any device.
        hidden: H.
        inter: I, the expert intermediate size.

    Returns:
        (gate_up [E, 2I, H], down [E, H, I]) bf16 views of `experts`.
    """
    words = experts.view(torch.bfloat16)
    return (
        words[:, : 2 * inter * hidden].view(-1, 2 * inter, hidden),
        words[:, 2 * inter * hidden : 3 * inter * hidden].view(-1, hidden, inter),
    )


def grouped_swiglu(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Weighted sum of SwiGLU experts picked by index into stacked weights.

    Args:
        hidden: [T, H] activations.
        gate_up: [E, 2I, H] gate rows then up rows per expert or slot (any stride between experts).
        down: [E, H, I].
        topk_ids: [T, k] int64 indices into the first dim; negative: skip that pick (computed elsewhere).
        topk_weights: [T, k] routing weights.

    Returns:
        [T, H] in hidden's dtype. On CUDA the Triton grouped kernel (`freetoken.kernels.fused_moe`; no host
        sync). On the CPU one SwiGLU per expert that has tokens, in index order, accumulated as transformers'
        `Qwen3MoeExperts` does; weights stored in another dtype (bf16 slots) are cast to hidden's.
    """
    if hidden.device.type in KERNEL_DEVICES:
        from freetoken.kernels.fused_moe import fused_moe

        return fused_moe(hidden, gate_up, down, topk_ids, topk_weights)
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    keep = flat_ids >= 0
    order = torch.argsort(torch.where(keep, flat_ids, gate_up.shape[0]), stable=True)[: int(keep.sum())]
    counts = torch.bincount(flat_ids[keep], minlength=gate_up.shape[0]).tolist()
    token_of_pair = order // k
    rows = hidden[token_of_pair]  # (pairs kept, H), grouped by expert
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        seg = rows[start : start + count]
        gate, up = F.linear(seg, gate_up[expert].to(hidden.dtype)).chunk(2, dim=-1)
        out[start : start + count] = F.linear(F.silu(gate) * up, down[expert].to(hidden.dtype))
        start += count
    out = out * topk_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden).index_add_(0, token_of_pair, out)
