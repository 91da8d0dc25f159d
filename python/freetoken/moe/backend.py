"""The seam between the MoE layer and wherever its experts live.

The model owns attention, norms and the router; it never holds routed-expert weights. A backend receives each
layer's routed experts once at load time (`load_layer`) and, on every forward, the hidden states with their
top-k ids and weights, and returns the weighted sum of the experts' outputs. A backend may keep the experts on
the compute device (`fused`), in host RAM with a slot cache on the GPU (`offload`, `hybrid`), or run them on the
CPU (`cpu`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class ExpertBackend(Protocol):
    """Computes the routed experts of MoE layers (SwiGLU: y = down(silu(gate x) * up x)).

    Attributes:
        wants_weights: True when the loader must hand it each layer's experts (`load_layer`); False when it
            reads them itself (the host `ExpertPool`).
        graph_safe: True when `forward` never syncs with the host, so a decode step can be a CUDA graph.
    """

    wants_weights: bool
    graph_safe: bool

    def load_layer(self, layer: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Take the routed experts of decoder layer `layer`.

        Args:
            layer: decoder layer index (0-based, as in the checkpoint's tensor names).
            gate_up: [E, 2I, H], gate_proj rows then up_proj rows of each expert (transformers 5 `gate_up_proj`).
            down: [E, H, I], each expert's down_proj.
        """
        ...

    def begin_step(self, num_tokens: int, num_prefill_tokens: int, top_k: int) -> None:
        """Called before each forward pass with the step's size: `num_tokens` in all, `num_prefill_tokens` of them
        from prompts (0 for a decode step), `top_k` experts per token. Backends that serve prefill and decode
        differently (`freetoken.moe.prefill`) choose here; others ignore it."""
        ...

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of the routed experts' outputs.

        Args:
            layer: decoder layer index.
            hidden: [T, H] hidden states (model dtype, compute device).
            topk_ids: [T, k] int64 expert ids per token.
            topk_weights: [T, k] routing weights (model dtype).

        Returns:
            [T, H], sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]).
        """
        ...
