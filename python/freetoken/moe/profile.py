"""Bandwidth profiles: what `ft bench bw` measured on one GPU and expert shape, read back by `--moe-backend`.

A profile is one JSON file per GPU (by UUID) and expert shape, in `profile_dir()`:
`$FREETOKEN_PROFILE_DIR`, else `$XDG_CACHE_HOME/freetoken/profiles` (see `freetoken.paths.cache_root`).
Written atomically (a temp file in the same directory, then `os.replace`), so a reader never sees half a file.

Schema (`SCHEMA_VERSION` 1; bandwidths in bytes/s; CPU curves keyed by tokens per expert as strings)::

    {"schema_version": 1, "freetoken_version": "...", "created_unix_s": 1.8e9,
     "gpu": {"uuid", "name", "index", "cuda_runtime", "driver", "pci_bus_id", "pcie_link", "total_memory_bytes"},
     "host": {"cpu_model", "num_cpus", "kernel_threads", "isa"},
     "expert": {"hidden_size", "intermediate_size", "dtype", "expert_nbytes"},
     "method": {...},                       # how it was measured (pool size, seconds, experts per call)
     "measured": {...},                     # every figure of the run, alone and overlapped
     "planner": {"pcie_bytes_per_s": float, "cpu_bytes_per_s": {"1": float, "2": ..., "16": ...}},
     "verdict": {"backend": "offload" | "hybrid", "q_star_b1": float, "hybrid_min_q_star": float},
     "formats": {"nvfp4": {"expert_nbytes", "block", "measured": {...}, "planner": {...}}, ...}}  # optional

The top-level figures are the bf16 experts'. `formats` holds each quantized expert format's own (keys as
`ExpertFormat.name`: fp8_block, nvfp4, mxfp4), measured as bf16's on a pool of that format (its own host kernels,
copies of its expert size; bytes/s of its expert bytes, scales included), in the same "measured" / "planner" form.
`planner_bandwidths(profile, fmt)` is the accessor; a profile without the format's entry (older, or measured without
it) gives bf16's figures in bytes/s, so an expert's time scales with its bytes, and says so in a log line.

`planner` holds the figures q* uses: those measured with copies and CPU kernels running at once (they share the
memory bus): B_cpu(b) overlapped at each b, and B_pcie the median over b of the copies overlapped with them. A profile
is used only when it is readable, of this schema, not stale (`MAX_AGE_S`, same freetoken version), and made on this GPU
for this expert shape; otherwise the reason is logged and it is ignored.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from freetoken import __version__
from freetoken._core import cpu_bytes_per_s_at, q_star
from freetoken.errors import FreetokenError
from freetoken.paths import cache_root

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# A profile older than this is stale: a box changes (DIMMs, BIOS, driver, other tenants) over weeks.
MAX_AGE_S = 30 * 24 * 3600
# hybrid when q*(b=1) reaches this. Splitting misses shortens a step's miss time by the factor (1 - q*) over
# offload, but a CPU run buys no future hit (the next token's fill of that expert is still to pay) and each
# layer step sends the hidden states to the host; below a 15 % saving those costs and the measurement's noise
# (a few %) eat the gain.
HYBRID_MIN_Q_STAR = 0.15
BATCHES = (1, 2, 4, 8, 16)


class ProfileError(FreetokenError, ValueError):
    """A profile that cannot be used: unreadable, corrupt, of another schema or version, or stale."""


@dataclass(frozen=True)
class ExpertShape:
    """The shape of one routed expert, as the host pool stores it (SwiGLU: gate_up [2I, H], down [H, I]).

    Attributes:
        hidden_size: H, in elements.
        intermediate_size: I (`moe_intermediate_size`), in elements.
        dtype: the pool's storage dtype ("bfloat16": the pool packs BF16, F16 and F32 checkpoints as bf16).
        expert_nbytes: bytes of one expert, 3 * H * I * 2.
    """

    hidden_size: int
    intermediate_size: int
    dtype: str = "bfloat16"

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert in the pool (gate, up and down projections in bf16)."""
        return 3 * self.hidden_size * self.intermediate_size * 2

    def to_dict(self) -> dict[str, Any]:
        """The profile's JSON form of the shape (the fields and `expert_nbytes`)."""
        return {**asdict(self), "expert_nbytes": self.expert_nbytes}

    def label(self) -> str:
        """e.g. "H2048 I768 bfloat16"."""
        return f"H{self.hidden_size} I{self.intermediate_size} {self.dtype}"


def profile_dir() -> Path:
    """$FREETOKEN_PROFILE_DIR, else `cache_root() / "profiles"` ($XDG_CACHE_HOME/freetoken/profiles)."""
    if os.environ.get("FREETOKEN_PROFILE_DIR"):
        return Path(os.environ["FREETOKEN_PROFILE_DIR"])
    return cache_root() / "profiles"


def profile_path(directory: Path, gpu_uuid: str, shape: ExpertShape) -> Path:
    """`directory/<uuid>_h<H>_i<I>_<dtype>.json` (characters outside [A-Za-z0-9.-] of the UUID become "_")."""
    safe = re.sub(r"[^A-Za-z0-9.-]", "_", gpu_uuid)
    return directory / f"{safe}_h{shape.hidden_size}_i{shape.intermediate_size}_{shape.dtype}.json"


def write_profile(path: Path, profile: dict[str, Any]) -> None:
    """Write `profile` as JSON to `path` atomically: a temp file beside it, fsync, then `os.replace`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ProfileError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def planner_bandwidths(profile: dict[str, Any], fmt: str = "bf16") -> tuple[float, dict[int, float]]:
    """(B_pcie bytes/s, {batch: B_cpu bytes/s}) the planner uses for experts of format `fmt` (`ExpertFormat.name`).

    bf16: the profile's "planner" section. A quantized format: its entry under "formats" when the profile has one;
    otherwise bf16's figures, in bytes/s (so a smaller expert takes proportionally less time), logged at info.

    Raises:
        ProfileError: the section used is missing or has non-positive figures.
    """
    section: Any = profile.get("planner")
    what = "planner"
    if fmt != "bf16":
        formats = profile.get("formats")
        entry = formats.get(fmt) if isinstance(formats, dict) else None
        if entry is None:
            log.info(
                "bandwidth profile has no %s figures (measured: %s): the planner takes bf16's bytes/s for %s experts, "
                "so their time is bf16's scaled by their bytes; `ft bench bw --format %s` measures them",
                fmt, ", ".join(["bf16", *(formats or {})]), fmt, fmt,
            )  # fmt: skip
        else:
            section, what = entry.get("planner") if isinstance(entry, dict) else None, f"formats.{fmt}.planner"
    try:
        pcie = _positive(section["pcie_bytes_per_s"], f"{what}.pcie_bytes_per_s")
        curve = {int(b): _positive(v, f"{what}.cpu_bytes_per_s[{b}]") for b, v in section["cpu_bytes_per_s"].items()}
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ProfileError(f"bad {what} section ({e})") from None
    if not curve or min(curve) < 1:
        raise ProfileError(f"{what}.cpu_bytes_per_s needs batch points >= 1")
    return pcie, curve


def read_profile(path: Path, now_s: float | None = None) -> dict[str, Any]:
    """Read and check a profile: JSON object, schema version, freetoken version, age, planner figures.

    Args:
        path: the file.
        now_s: the current time (Unix seconds; default `time.time()`), for the age check.

    Raises:
        ProfileError: unreadable, not JSON, another schema or freetoken version, older than `MAX_AGE_S`, or
            missing / non-positive planner figures (bf16's or a listed format's). The message says which.
    """
    try:
        profile = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"not valid JSON ({e})") from None
    if not isinstance(profile, dict):
        raise ProfileError(f"expected a JSON object, got {type(profile).__name__}")
    if profile.get("schema_version") != SCHEMA_VERSION:
        raise ProfileError(f"schema_version {profile.get('schema_version')!r}, this freetoken reads {SCHEMA_VERSION}")
    if profile.get("freetoken_version") != __version__:
        raise ProfileError(f"stale: made by freetoken {profile.get('freetoken_version')!r}, this is {__version__}")
    created = _positive(profile.get("created_unix_s"), "created_unix_s")
    age_s = (time.time() if now_s is None else now_s) - created
    if age_s > MAX_AGE_S:
        raise ProfileError(f"stale: {age_s / 86400:.0f} days old (limit {MAX_AGE_S // 86400} days)")
    for key in ("gpu", "expert"):
        if not isinstance(profile.get(key), dict):
            raise ProfileError(f"missing section {key!r}")
    formats = profile.get("formats", {})
    if not isinstance(formats, dict):
        raise ProfileError(f"formats must be an object, got {type(formats).__name__}")
    for fmt in ("bf16", *formats):
        planner_bandwidths(profile, fmt)
    return profile


def verdict(pcie_bytes_per_s: float, cpu_bytes_per_s: dict[int, float]) -> tuple[str, float]:
    """("hybrid" or "offload", q* at b=1): hybrid when q*(1) >= `HYBRID_MIN_Q_STAR`."""
    q1 = q_star(pcie_bytes_per_s, cpu_bytes_per_s, 1)  # the planner's rule (`BandwidthProfile::q`), from Rust
    return ("hybrid" if q1 >= HYBRID_MIN_Q_STAR else "offload"), q1


def _describe(profile: dict[str, Any]) -> str:
    gpu, expert = profile.get("gpu", {}), profile.get("expert", {})
    return (
        f"GPU {gpu.get('uuid')!r} ({gpu.get('name')}), expert H{expert.get('hidden_size')} "
        f"I{expert.get('intermediate_size')} {expert.get('dtype')}"
    )


def find_profile(
    gpu_uuid: str, shape: ExpertShape, directory: Path | None = None, now_s: float | None = None
) -> dict[str, Any] | None:
    """The usable profile of GPU `gpu_uuid` and expert `shape` in `directory` (default `profile_dir()`), or None.

    Logs the profile used. A file that is unreadable, corrupt, of another schema or stale is reported (warning)
    and not used; when there is none for this GPU and shape, each profile of another GPU or shape in the
    directory is reported as ignored. Never raises for a bad file.
    """
    directory = profile_dir() if directory is None else directory
    path = profile_path(directory, gpu_uuid, shape)
    if path.is_file():
        try:
            profile = read_profile(path, now_s)
        except ProfileError as e:
            log.warning("bandwidth profile %s not used: %s; rerun `ft bench bw`", path, e)
            return None
        if profile["gpu"].get("uuid") != gpu_uuid or profile["expert"] != shape.to_dict():
            log.warning("bandwidth profile %s ignored: it is for %s", path, _describe(profile))
            return None
        pcie, curve = planner_bandwidths(profile)
        backend, q1 = verdict(pcie, curve)
        log.info(
            "bandwidth profile %s: B_pcie %.1f GB/s, B_cpu(1) %.1f GB/s, q*(1) %.2f -> %s",
            path, pcie / 1e9, cpu_bytes_per_s_at(curve, 1) / 1e9, q1, backend,
        )  # fmt: skip
        return profile
    for other in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            log.warning(
                "bandwidth profile %s ignored: it is for %s, not GPU %r with expert %s",
                other, _describe(read_profile(other, now_s)), gpu_uuid, shape.label(),
            )  # fmt: skip
        except ProfileError as e:
            log.warning("bandwidth profile %s not used: %s", other, e)
    log.info(
        "no bandwidth profile for GPU %r and expert %s in %s (run `ft bench bw`)", gpu_uuid, shape.label(), directory
    )
    return None
