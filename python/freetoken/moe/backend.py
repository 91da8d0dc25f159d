"""The seam between the MoE layer and wherever its experts live.

The model owns attention, norms and the router; it never holds routed-expert weights. A backend receives each
layer's routed experts once at load time (`load_layer`) and, on every forward, the hidden states with their
top-k ids and weights, and returns the weighted sum of the experts' outputs. A backend may keep the experts on
the compute device (`fused`), in host RAM with a slot cache on the GPU (`offload`, `hybrid`), or run them on the
CPU (`cpu`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from freetoken._core import StepReport
    from freetoken.moe.handshake import DeviceHandshake
    from freetoken.quant.formats import ExpertLayout


@runtime_checkable
class ExpertBackend(Protocol):
    """Computes the routed experts of MoE layers (SwiGLU: y = down(silu(gate x) * up x)).

    Attributes:
        wants_weights: True when the loader must hand it each layer's experts (`load_layer`, or
            `load_layer_quantized` for a quantized checkpoint); False when it reads them itself (the host
            `ExpertPool`).
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

    def load_layer_quantized(self, layer: int, layout: ExpertLayout, packed: torch.Tensor) -> None:
        """Take the routed experts of decoder layer `layer` quantized, as the checkpoint stores them.

        Args:
            layer: decoder layer index.
            layout: the format's byte layout of one expert (`freetoken.quant.formats.ExpertLayout`).
            packed: [E, layout.expert_nbytes] uint8 on the compute device, each row one expert in the pool layout
                (codes, then their scales: `freetoken.quant.checkpoint.read_experts`).
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

    def stats(self) -> dict[str, Any]:
        """JSON-able counters for `/v1/stats` (at least `{"backend": name}`)."""
        ...


@runtime_checkable
class DrivenExpertBackend(ExpertBackend, Protocol):
    """A backend whose layer step runs on the host (`ExpertCacheBackend`): besides `forward`, what the decode runners
    call. Declared here so the engine checks one type (`isinstance`) instead of probing for methods; the three paths
    are drawn in `freetoken/moe/README.md`.
    """

    def device_handshake(self, top_k: int, sizes: list[int]) -> DeviceHandshake:
        """The decode driver's handshake for steps captured whole in CUDA graphs, for padded batch sizes `sizes`
        (`engine.cuda_graph.DrivenGraphRunner`). Raises ValueError where there are no graphs (the CPU device)."""
        ...

    def forward_staged(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        host_ids: torch.Tensor,
        host_weights: torch.Tensor,
        host_hidden: torch.Tensor,
        out: torch.Tensor,
        cpu_out: torch.Tensor,
    ) -> None:
        """`forward` between the spans of a staged decode step (`engine.cuda_graph.StagedRunner`), whose span already
        queued the copies of the routing and hidden states into the pinned host buffers (shapes in
        `ExpertCacheBackend`)."""
        ...

    def run_slots(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        sorted_pairs: torch.Tensor,
        tile_stages: torch.Tensor,
        out: torch.Tensor | None,
        before_stage: Any = None,
    ) -> torch.Tensor:
        """The slot kernel over a driven step's aligned tiles (hits, then fills after `before_stage(1)`)."""
        ...

    def after_driven_step(self, report: StepReport) -> None:
        """Book a driven decode step's report."""
        ...

    def after_failed_driven_step(self) -> None:
        """A driven step failed part way: drop what its fills may have made stale."""
        ...
