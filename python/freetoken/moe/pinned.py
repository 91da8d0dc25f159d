"""Page-locked host memory: the expert pool's arena, and the small buffers every layer step copies through.

Copies between the device and pageable memory are staged by the driver and block the host, so every buffer on
the decode path is page-locked. Ours are registered with `cudaHostRegister` rather than allocated by torch's
pinned allocator: that allocator records a CUDA event on each of its blocks at every non-blocking copy (so it
knows when a block may be reused), one more CUDA call per copy, which the per-layer path cannot afford and does
not need (each layer step syncs before it writes a buffer again).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from freetoken.errors import FreetokenError

# Live owners per registered address: several owners may pin one range (backends sharing a pool); the range is
# registered by the first and unregistered by the last.
_OWNERS: dict[int, int] = {}


class PinningError(FreetokenError, RuntimeError):
    """`cudaHostRegister` refused a range: the message has the CUDA error and what to change."""


class PinnedRegion:
    """Owner of one page-locked host range (`cudaHostRegister`), so copies from it run as DMA at PCIe line rate;
    unregisters it (`cudaHostUnregister`) on `close()`, on leaving a `with` block, or when collected, once no other
    owner of the same address is left.

    Args:
        ptr, nbytes: the range (host address, bytes).
        keep: the object that owns the memory, kept alive as long as the region, so the memory cannot be freed
            while registered.
        cudart: the CUDA runtime bindings (`torch.cuda.cudart()` by default; tests pass a fake).

    Raises:
        PinningError: the registration failed (with the CUDA error code).
    """

    def __init__(self, ptr: int, nbytes: int, keep: object = None, cudart: Any = None) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        self._keep = keep
        self._cudart = cudart if cudart is not None else torch.cuda.cudart()
        self._open = False
        if _OWNERS.get(ptr, 0) == 0:
            err = self._cudart.cudaHostRegister(ptr, nbytes, 0)
            code = getattr(err, "value", err)
            if code != 0:
                raise PinningError(
                    f"cudaHostRegister of {nbytes / 1e9:.3f} GB of host memory failed (CUDA error {code}); "
                    "raise RLIMIT_MEMLOCK (ulimit -l) or free host memory"
                )
        _OWNERS[ptr] = _OWNERS.get(ptr, 0) + 1
        self._open = True

    def close(self) -> None:
        """Give up this owner's hold; the last one unregisters the range. Idempotent."""
        if not self._open:
            return
        self._open = False
        left = _OWNERS.pop(self.ptr) - 1
        if left:
            _OWNERS[self.ptr] = left
        else:
            self._cudart.cudaHostUnregister(self.ptr)
        self._keep = None

    def __enter__(self) -> PinnedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class PinnedBuffers:
    """Host buffers reused across layer steps, one per name, grown on demand; page-locked when `pin` (CUDA).

    Reuse is safe because every on-demand layer step syncs the compute stream before it writes them again, so the
    copies that last read or wrote them have completed; no allocation (and none of its CUDA calls) per step.
    Buffers are unregistered when replaced by a larger one and when this object goes away (their `PinnedRegion`s).
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}
        self._regions: dict[str, PinnedRegion] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous `shape` view of buffer `name` (contents undefined)."""
        numel = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0)
            if name in self._regions:
                self._regions.pop(name).close()
            buf = self._buffers[name] = torch.empty(size, dtype=dtype)
            if self.pin:
                self._regions[name] = PinnedRegion(buf.data_ptr(), buf.numel() * buf.element_size(), keep=buf)
        return buf[:numel].view(shape)
