"""`fused` backend: every routed expert resident on the compute device (the ceiling; only when they fit)."""

from __future__ import annotations

import torch

from freetoken.moe.compute import grouped_swiglu
from freetoken.quant.experts import QuantizedExperts
from freetoken.quant.formats import ExpertLayout


class FusedExperts:
    """All experts of all MoE layers as stacked tensors on one device.

    Per layer: `gate_up` [E, 2I, H] and `down` [E, H, I], model dtype; the forward is `grouped_swiglu` over
    expert ids (no host sync on CUDA, so a decode step can be captured in a CUDA graph).
    """

    graph_safe = True
    wants_weights = True

    def __init__(self) -> None:
        self.gate_up: dict[int, torch.Tensor] = {}
        self.down: dict[int, torch.Tensor] = {}
        self.quantized: dict[int, QuantizedExperts] = {}

    def load_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Keep the layer's experts as given (already on the compute device, in the model dtype)."""
        self.gate_up[layer] = gate_up
        self.down[layer] = down

    def load_layer_quantized(self, layer: int, layout: ExpertLayout, packed: torch.Tensor) -> None:
        """Keep the layer's experts quantized: `packed` [E, expert_nbytes] uint8 in `layout` (pool layout), on the
        compute device; `forward` runs `freetoken.quant.experts.quantized_swiglu` over them (the Triton kernel that
        dequantizes in its inner loop on CUDA)."""
        self.quantized[layer] = QuantizedExperts(layout, packed)

    def begin_step(self, num_tokens: int, num_prefill_tokens: int, top_k: int) -> None:
        """Nothing to choose: every expert is resident."""

    def stats(self) -> dict:
        """`{"backend": "fused"}`, and once a layer is loaded the experts' format and bytes per expert as the
        expert cache reports them (`expert_format`: the quantized format's name, else "bf16" or the torch dtype
        the experts are held in; `expert_nbytes`): nothing is planned or moved."""
        out: dict = {"backend": "fused"}
        if self.quantized:
            layout = next(iter(self.quantized.values())).layout
            out.update(expert_format=layout.format.name, expert_nbytes=layout.expert_nbytes)
        elif self.gate_up:
            layer = next(iter(self.gate_up))
            gate_up, down = self.gate_up[layer], self.down[layer]
            dtype = str(gate_up.dtype).removeprefix("torch.")
            out.update(
                expert_format="bf16" if dtype == "bfloat16" else dtype,
                expert_nbytes=(gate_up[0].numel() + down[0].numel()) * gate_up.element_size(),
            )
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held by all experts."""
        dense = sum(t.numel() * t.element_size() for t in (*self.gate_up.values(), *self.down.values()))
        return dense + sum(q.nbytes for q in self.quantized.values())

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """See `ExpertBackend.forward`: [T, H] hidden, [T, k] ids and weights -> [T, H]."""
        if layer in self.quantized:
            return self.quantized[layer].forward(hidden, topk_ids, topk_weights)
        return grouped_swiglu(hidden, self.gate_up[layer], self.down[layer], topk_ids, topk_weights)
