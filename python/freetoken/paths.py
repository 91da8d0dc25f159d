"""Where freetoken keeps what it builds (demo checkpoints, converted tokenizers, preset directories)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """$FREETOKEN_CACHE_DIR, else $XDG_CACHE_HOME/freetoken, else ~/.cache/freetoken."""
    if os.environ.get("FREETOKEN_CACHE_DIR"):
        return Path(os.environ["FREETOKEN_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "freetoken"


def atomic_build(final: Path, build: Callable[[Path], object]) -> Path:
    """Run `build(tmp_dir)` in a sibling temp dir and rename it to `final`; reuse `final` if present."""
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.exists():  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
