"""Giving freed memory back to the system.

CPython frees big objects at once, but objects in reference cycles (an exception's traceback holds its frames and
their locals: a refused request's body, JSON and rendering) wait for the collector's next full pass, and glibc
keeps freed pages in its arenas (one per thread that allocated: the server's worker threads, the engine thread,
the tokenizer's). The server calls `release_free_memory` after a large request body and the engine thread when it
goes idle after work, so RSS returns to its baseline after a burst instead of staying at its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Any


def release_free_memory() -> None:
    """Collect reference cycles, then hand the C heap's free pages back to the system (glibc's malloc_trim; that
    part is a no-op elsewhere)."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
