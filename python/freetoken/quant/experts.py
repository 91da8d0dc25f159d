"""Routed experts kept in a quantized format on the compute device: the `fused` backend's, and the slot kernel of
the expert cache.

`QuantizedExperts` holds one MoE layer's experts as packed bytes in the pool layout (`freetoken.quant.formats`);
`quantized_swiglu` computes over such rows (experts, or the expert cache's slots): the Triton kernel on CUDA, and on
the CPU `grouped_swiglu` through `DequantizedView`, which dequantizes one expert when the computation asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.moe.compute import grouped_swiglu
from freetoken.quant.formats import ExpertLayout
from freetoken.quant.reference import dequantize_experts


@dataclass
class QuantizedExperts:
    """One layer's routed experts in a quantized format.

    Attributes:
        layout: the experts' `ExpertLayout` (format, H, I, where each section sits).
        packed: [E, expert_nbytes] uint8 in the pool layout, on the compute device.
    """

    layout: ExpertLayout
    packed: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held (weights and scales)."""
        return self.packed.numel()

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """`quantized_swiglu` over these experts: [T, H] hidden, [T, k] ids and weights -> [T, H]."""
        return quantized_swiglu(hidden, self.packed, self.layout, topk_ids, topk_weights)


def quantized_swiglu(
    hidden: torch.Tensor,
    packed: torch.Tensor,
    layout: ExpertLayout,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    alignment: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`freetoken.moe.compute.grouped_swiglu` over quantized experts, by expert id (`fused`) or slot id (the expert
    cache): the one entry point of every backend for a quantized layer.

    Args:
        hidden: [T, H] activations.
        packed: [S, stride >= expert_nbytes] uint8, one expert (or cache slot) per row in `layout`, on hidden's device.
        layout: the experts' `ExpertLayout` (a quantized format).
        topk_ids: [T, k] int64 rows of `packed`; negative: skip that pick (computed elsewhere).
        topk_weights: [T, k] routing weights.
        alignment: on CUDA, `align_pairs(topk_ids, S, block_m_for(T * k))` when the caller has it.
        out: [T, H] buffer for the result (hidden's dtype); None allocates.

    Returns:
        [T, H] in hidden's dtype. On CUDA the Triton kernel that dequantizes in its inner loop
        (`freetoken.kernels.fused_moe_quant`, no host sync). On the CPU each expert that has tokens is dequantized
        (float32, `reference.dequantize_experts`) when its turn comes, so the full-precision layer never exists.
    """
    if hidden.is_cuda:
        from freetoken.kernels.fused_moe_quant import fused_moe_quant

        return fused_moe_quant(hidden, packed, layout, topk_ids, topk_weights, alignment=alignment, out=out)
    view = DequantizedView(QuantizedExperts(layout, packed))
    # duck-typed: grouped_swiglu only indexes its weights per expert, which the view dequantizes on demand
    y = grouped_swiglu(hidden, view.gate_up, view.down, topk_ids, topk_weights)  # type: ignore[arg-type]
    return y if out is None else out.copy_(y)


class DequantizedView:
    """Stand-ins for the stacked `gate_up` [E, 2I, H] and `down` [E, H, I] that `grouped_swiglu` indexes by expert:
    `view.gate_up[e]` and `view.down[e]` dequantize expert `e` (float32) once and keep the last one."""

    def __init__(self, experts: QuantizedExperts) -> None:
        self._experts = experts
        self._last: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        num = experts.packed.shape[0]
        h, i = experts.layout.hidden, experts.layout.inter
        self.gate_up = _Part(self, 0, (num, 2 * i, h))
        self.down = _Part(self, 1, (num, h, i))

    def expert(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) float32 of expert `index`."""
        if self._last is None or self._last[0] != index:
            gate_up, down = dequantize_experts(self._experts.layout, self._experts.packed[index : index + 1])
            self._last = (index, (gate_up[0], down[0]))
        return self._last[1]


class _Part:
    """One of `DequantizedView`'s two stacks: `shape` and indexing by expert, as `grouped_swiglu` uses them."""

    def __init__(self, view: DequantizedView, which: int, shape: tuple[int, int, int]) -> None:
        self._view, self._which, self.shape = view, which, shape

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._view.expert(int(index))[self._which]
