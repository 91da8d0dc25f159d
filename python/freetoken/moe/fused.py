"""`fused` backend: every routed expert resident on the compute device (the ceiling; only when they fit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FusedExperts:
    """All experts of all MoE layers as stacked tensors on one device.

    Per layer: `gate_up` [E, 2I, H] and `down` [E, H, I], model dtype. On CUDA the forward is the Triton grouped
    SwiGLU (`freetoken.kernels.fused_moe`, no host sync, CUDA-graph safe). On the CPU it groups the step's
    (token, expert) pairs by expert and runs one SwiGLU per expert that has tokens, in expert order, then
    scatters the weighted rows back (the same order of accumulation as transformers' `Qwen3MoeExperts`).
    """

    def __init__(self) -> None:
        self.gate_up: dict[int, torch.Tensor] = {}
        self.down: dict[int, torch.Tensor] = {}

    def load_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Keep the layer's experts as given (already on the compute device, in the model dtype)."""
        self.gate_up[layer] = gate_up
        self.down[layer] = down

    @property
    def nbytes(self) -> int:
        """Bytes held by all experts."""
        return sum(t.numel() * t.element_size() for t in (*self.gate_up.values(), *self.down.values()))

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """See `ExpertBackend.forward`: [T, H] hidden, [T, k] ids and weights -> [T, H]."""
        gate_up, down = self.gate_up[layer], self.down[layer]
        if hidden.is_cuda:
            from freetoken.kernels.fused_moe import fused_moe

            return fused_moe(hidden, gate_up, down, topk_ids, topk_weights)
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
        token_of_pair = order // k
        rows = hidden[token_of_pair]  # (T*k, H), grouped by expert
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            seg = rows[start : start + count]
            gate, up = F.linear(seg, gate_up[expert]).chunk(2, dim=-1)
            out[start : start + count] = F.linear(F.silu(gate) * up, down[expert])
            start += count
        out = out * topk_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden).index_add_(0, token_of_pair, out)
