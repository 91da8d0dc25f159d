"""Page-locked host memory: the expert pool's arena, and the small buffers every layer step copies through.

Copies between the device and pageable memory are staged by the driver and block the host, so every buffer on
the decode path is page-locked. Ours are registered with `cudaHostRegister` rather than allocated by torch's
pinned allocator: that allocator records a CUDA event on each of its blocks at every non-blocking copy (so it
knows when a block may be reused), one more CUDA call per copy, which the per-layer path cannot afford and does
not need (each layer step syncs before it writes a buffer again).
"""

from __future__ import annotations

import numpy as np
import torch

_PINNED: set[int] = set()


def pin_host_memory(ptr: int, nbytes: int) -> None:
    """Page-lock `nbytes` at `ptr` for CUDA (cudaHostRegister), so copies from it run as DMA at PCIe line rate.
    Idempotent per pointer (several backends may share one pool). Raises RuntimeError with the CUDA error and
    what to change."""
    if ptr in _PINNED:
        return
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    code = getattr(err, "value", err)
    if code != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes / 1e9:.3f} GB of host memory failed (CUDA error {code}); "
            "raise RLIMIT_MEMLOCK (ulimit -l) or free host memory"
        )
    _PINNED.add(ptr)


def unpin_host_memory(ptr: int) -> None:
    """Undo `pin_host_memory` (cudaHostUnregister) before the memory is freed; no-op for a pointer not pinned."""
    if ptr in _PINNED:
        torch.cuda.cudart().cudaHostUnregister(ptr)
        _PINNED.discard(ptr)


class PinnedBuffers:
    """Host buffers reused across layer steps, one per name, grown on demand; page-locked when `pin` (CUDA).

    Reuse is safe because every on-demand layer step syncs the compute stream before it writes them again, so the
    copies that last read or wrote them have completed; no allocation (and none of its CUDA calls) per step.
    Buffers are unregistered when replaced by a larger one and when this object goes away.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous `shape` view of buffer `name` (contents undefined)."""
        numel = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            if buf is not None and self.pin:
                unpin_host_memory(buf.data_ptr())
            buf = self._buffers[name] = torch.empty(size, dtype=dtype)
            if self.pin:
                pin_host_memory(buf.data_ptr(), buf.numel() * buf.element_size())
        return buf[:numel].view(shape)

    def __del__(self) -> None:
        if self.pin:
            for buf in self._buffers.values():
                try:
                    unpin_host_memory(buf.data_ptr())
                except Exception:  # noqa: BLE001 (interpreter shutdown: the CUDA runtime may be gone)
                    pass
