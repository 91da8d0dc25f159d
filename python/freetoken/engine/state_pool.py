"""The recurrent-state pool: per running sequence, the state of every linear-attention (Gated DeltaNet) layer.

A hybrid model's linear-attention layers compress a sequence's past into fixed-size state instead of K/V per token:
per layer a short-convolution window (the last `K - 1` inputs of the causal conv, model dtype) and the delta-rule
state (`[Hv, Dk, Dv]`, float32). The pool sits beside the paged KV cache (which holds only the full-attention
layers' K/V): one slot per running sequence, taken when the scheduler admits it and given back when it finishes,
is aborted or is preempted (preemption recomputes the prompt from a zeroed slot, as it does the KV blocks).

Layout: per linear layer `conv [num_slots + 1, C, K - 1]` (C = `ModelConfig.linear_conv_dim`) and `ssm [num_slots + 1,
Hv, Dk, Dv]`, allocated once; slot `num_slots` is never handed out: padding rows of a fixed-shape (CUDA-graph) decode
step read and write it. Snapshots of a slot (checkpoints at special-token marks) copy these rows out and back
(`copy_slot`).
"""

from __future__ import annotations

import torch

from freetoken.config import ModelConfig


class RecurrentStatePool:
    """Conv and delta-rule states of `num_slots` sequences for every linear-attention layer of `cfg`.

    Args:
        cfg: the model (its `linear_layers` and `linear_*` sizes).
        num_slots: sequences held at once (the engine uses `max_num_seqs`).
        dtype: the conv window's dtype (the model's); the delta-rule state is always float32.
        device: where the states live (the compute device).

    Raises:
        ValueError: `num_slots` < 1.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"recurrent-state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.null_slot = num_slots
        width = cfg.linear_conv_kernel_dim - 1
        heads, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            layer: (
                torch.zeros(num_slots + 1, cfg.linear_conv_dim, width, dtype=dtype, device=device),
                torch.zeros(num_slots + 1, heads, dk, dv, dtype=torch.float32, device=device),
            )
            for layer in cfg.linear_layers
        }
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one sequence's states over all linear layers (conv window in `dtype`, delta-rule state float32)."""
        size = torch.empty((), dtype=dtype).element_size()
        conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel_dim - 1) * size
        ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        return len(cfg.linear_layers) * (conv + ssm)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (null slot included)."""
        return sum(c.numel() * c.element_size() + s.numel() * s.element_size() for c, s in self.layers.values())

    @property
    def num_free(self) -> int:
        """Slots not held by a sequence."""
        return len(self._free)

    def allocate(self) -> int:
        """Take a slot and zero its states (a sequence starts from the zero state). Raises MemoryError when none is
        free (the scheduler admits at most `num_slots` sequences, so this is a bug upstream)."""
        if not self._free:
            raise MemoryError(f"recurrent-state pool: all {self.num_slots} slots are held")
        slot = self._free.pop()
        for conv, ssm in self.layers.values():
            conv[slot].zero_()
            ssm[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give `slot` back. Raises ValueError for a slot that is not held (a double free would hand it out twice)."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"recurrent-state slot {slot} is not held")
        self._free.append(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's states of slot `src` into slot `dst` (the primitive of snapshots and restores)."""
        for conv, ssm in self.layers.values():
            conv[dst].copy_(conv[src])
            ssm[dst].copy_(ssm[src])
