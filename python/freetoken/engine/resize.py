"""Resizing a running engine's expert-slot cache and KV cache (`POST /v1/cache/resize`, `ft ctl cache`).

`AsyncEngine` runs `resize` on the engine thread between two steps: the step in flight has ended, and requests in
flight or queued wait (nothing is failed, dropped or recomputed). In order:

1. plan (`plan_resize`): the new sizes from GB (or counts); what cannot be done is refused here, before anything
   changes (`ResizeRefused`): a backend without slots, a KV cache smaller than one context or than what running
   requests hold, a peak beyond the memory headroom (`headroom_bytes`);
2. tear down what holds the tensors' addresses: the decode runner, its CUDA graphs and the decode driver's device
   handshake (`ModelRunner.release_decode`);
3. allocate the new KV tensors while the old ones live (their K/V exist nowhere else);
4. resize the expert cache (`ExpertCacheBackend.resize`): the old slots are released, the new ones allocated, and
   the residents that fit, the most valuable by the cache policy, copied again from the pinned pool;
5. adopt the new KV tensors: every block a sequence holds and the cached prefix blocks that fit are copied and
   renumbered (`PrefixCache.keep_on_resize`); block tables and the prefix index follow (`PrefixCache.remap`); with
   a KV host tier (`freetoken.engine.kv_host`), the cached blocks that do not fit go to it first
   (`PrefixCache.spill`), and its blocks stay as they are;
6. build the decode runner again: graphs re-captured, the handshake on the new slots.

An allocation that fails at 3 or 4 (an out-of-memory error) leaves both caches at their old sizes: the new KV
tensors are dropped, the expert cache rolls itself back, the decode runner is rebuilt; `ResizeRolledBack` says so.

Peak memory: the new KV tensors live beside the old ones during the copy; the expert slots do not (the pool holds
every expert), so a resize needs `new KV + max(0, new slots - old slots)` bytes beyond what is in use.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from freetoken.moe.budget import activation_reserve_nbytes, host_available_bytes

if TYPE_CHECKING:
    from freetoken.engine.llm_engine import LLMEngine
    from freetoken.moe.expert_cache import ExpertCacheBackend

log = logging.getLogger(__name__)

# The allocation seams of a resize (`torch.zeros` / `torch.empty` signatures), module attributes so that a test can
# make one of them fail as the device allocator does.
allocate_kv = torch.zeros
allocate_slots = torch.empty

# Share of MemAvailable a resize may take on a CPU device (as `freetoken.moe.budget.check_host_memory` at start).
HOST_MEMORY_SHARE = 0.95
# Share of the device's free memory the default GPU budget takes (as `freetoken.moe.budget.plan_expert_slots`).
DEVICE_FREE_SHARE = 0.9


class ResizeError(Exception):
    """A resize that did not happen; `status` is the HTTP status the server answers with."""

    status = 422


class ResizeRefused(ResizeError):
    """The resize cannot be done on this server (it does not fit, or the backend has no such cache); nothing
    changed."""


class ResizeConflict(ResizeError):
    """Another resize is running."""

    status = 409


class ResizeRolledBack(ResizeError):
    """An allocation failed during the resize; both caches are back at their old sizes."""

    status = 503


@dataclass(frozen=True)
class ResizePlan:
    """What `resize` will do: the new slot count and KV block count (None: unchanged), the bytes it needs beyond
    what is in use at its peak, and notes for the answer (a size that was capped)."""

    num_slots: int | None
    num_kv_blocks: int | None
    peak_bytes: int
    notes: list[str] = field(default_factory=list)


T = TypeVar("T")


def _given(value: T | None) -> T:
    """`value`, known not to be None here (for mypy: a size given as GB when not as a count)."""
    assert value is not None
    return value


def _units_in_gb(gb: float, unit_nbytes: int) -> int:
    """Whole units of `unit_nbytes` bytes in `gb` GB (1e9 bytes), in exact integers: a float's bytes overflow to
    infinity for a huge `gb` (1e308 GB), which then cannot be a count. `gb` is read as its shortest decimal text
    (what the client wrote: 9.8304e-05 GB is 98304 bytes, not the binary float's 98303.99...)."""
    return int(Decimal(str(gb)) * 10**9) // unit_nbytes


def _gb_text(nbytes: int) -> str:
    """`nbytes` in GB for a message, for any size: a huge request's bytes overflow a float."""
    gb = Decimal(nbytes) / 10**9
    return f"{gb:.3f}" if gb < 10**9 else f"{gb:.3e}"


def _gb(nbytes: float) -> float:
    return round(nbytes / 1e9, 4)


def _slot_cache(engine: LLMEngine) -> ExpertCacheBackend | None:
    """The engine's expert cache when it has slots to resize (`offload`, `hybrid`), else None."""
    from freetoken.moe.expert_cache import ExpertCacheBackend  # the loader imports this module's engine first

    experts = engine.experts
    return experts if isinstance(experts, ExpertCacheBackend) and experts.mode != "cpu" else None


def cache_sizes(engine: LLMEngine) -> dict[str, Any]:
    """The expert-slot cache and the KV cache as they are now (JSON-able; cheap enough for every step's stats).

    Keys: "expert_cache" (None for the fused and cpu backends: no slots) with num_slots, slot_nbytes, nbytes, gb,
    num_resident, num_experts (in the pool), layer_buffers and policy; "kv_cache" with num_blocks, block_size,
    num_tokens, nbytes and gb (null block included), num_held_blocks (held by requests), num_cached_blocks (in the
    prefix index), num_free_blocks (free or evictable) and max_model_len; "num_resizes" and "last_resize" (its answer).
    """
    kv, prefix = engine.kv, engine.scheduler.prefix_cache
    experts = _slot_cache(engine)
    expert_cache = None
    if experts is not None:
        pool = experts.pool
        expert_cache = {
            "num_slots": experts.num_slots,
            "slot_nbytes": pool.expert_stride,
            "nbytes": experts.num_slots * pool.expert_stride,
            "gb": _gb(experts.num_slots * pool.expert_stride),
            "num_resident": experts.planner.num_resident,
            "num_experts": pool.num_layers * pool.num_experts,
            "layer_buffers": 0 if experts.streamer is None else experts.streamer.num_buffers,
            "policy": experts.planner.policy,
        }
    return {
        "expert_cache": expert_cache,
        "kv_cache": {
            "num_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "num_tokens": kv.num_blocks * kv.block_size,
            "nbytes": kv.nbytes,
            "gb": _gb(kv.nbytes),
            "num_held_blocks": kv.num_blocks - prefix.num_free,
            "num_cached_blocks": prefix.num_cached_blocks,
            "num_free_blocks": prefix.num_free,
            "max_model_len": engine.max_model_len,
        },
        "num_resizes": engine.num_resizes,
        "last_resize": engine.last_resize,
    }


def headroom_bytes(engine: LLMEngine) -> tuple[int | None, str]:
    """(bytes a resize may add at its peak, what bounds them), an estimate.

    On CUDA: the device's free memory plus what torch's allocator holds unused, less the activation reserve
    (`activation_reserve_nbytes`), and within `--gpu-memory-gb` when set (less what is allocated); without it the
    budget is what start-up would take (90 % of free). On a CPU device the caches are host memory: 95 % of
    MemAvailable. (None, ...) where the host does not say.
    """
    if engine.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(engine.device)
        allocated = torch.cuda.memory_allocated(engine.device)
        unused = torch.cuda.memory_reserved(engine.device) - allocated
        dtype = next(engine.runner.model.parameters()).dtype
        reserve = activation_reserve_nbytes(engine.cfg, engine.model_cfg, dtype)
        headroom = int(DEVICE_FREE_SHARE * free) + unused - reserve
        if engine.cfg.gpu_memory_gb:
            headroom = min(headroom, int(engine.cfg.gpu_memory_gb * 1e9) - allocated - reserve)
            return max(headroom, 0), f"the GPU budget (--gpu-memory-gb {engine.cfg.gpu_memory_gb:g})"
        return max(headroom, 0), "free GPU memory"
    available = host_available_bytes()
    if available is None:
        return None, "host memory"
    return int(HOST_MEMORY_SHARE * available), "host memory"


def plan_resize(
    engine: LLMEngine,
    expert_gb: float | None = None,
    kv_gb: float | None = None,
    expert_slots: int | None = None,
    kv_blocks: int | None = None,
) -> ResizePlan:
    """Check a resize against this engine and turn it into counts; changes nothing.

    Args:
        expert_gb / expert_slots: the expert-slot cache's new size, in GB (1e9 bytes, whole slots of
            `ExpertPool.expert_stride` bytes) or in slots; at most one of the two.
        kv_gb / kv_blocks: the KV cache's new size, in GB (whole blocks, sized as `plan_kv_cache` sizes them at
            start) or in blocks; at most one of the two.

    Raises:
        ResizeRefused: with what is wrong and what would do: nothing to resize, a backend without slots, a size of
            less than one slot, a KV cache below one context (`max_model_len`) or below the blocks requests hold,
            or a peak beyond the headroom (`headroom_bytes`).
    """
    if (expert_gb is not None and expert_slots is not None) or (kv_gb is not None and kv_blocks is not None):
        raise ResizeRefused("give each cache's size once: expert_gb or expert_slots, kv_gb or kv_blocks")
    if expert_gb is None and expert_slots is None and kv_gb is None and kv_blocks is None:
        raise ResizeRefused("nothing to resize: give expert_gb (or expert_slots) and/or kv_gb (or kv_blocks)")
    notes: list[str] = []
    num_slots = num_kv_blocks = None
    slot_delta = kv_peak = 0
    if expert_gb is not None or expert_slots is not None:
        experts = _slot_cache(engine)
        if experts is None:
            backend = engine.experts.stats()["backend"] if engine.experts is not None else "model's"
            raise ResizeRefused(
                f"the {backend} expert backend keeps no expert slots to resize; serve with --moe-backend offload or "
                "hybrid to have an expert cache"
            )
        stride, total = experts.pool.expert_stride, experts.pool.num_layers * experts.pool.num_experts
        num_slots = expert_slots if expert_slots is not None else _units_in_gb(_given(expert_gb), stride)
        if num_slots < 1:
            raise ResizeRefused(
                f"expert cache of {expert_gb if expert_slots is None else expert_slots} "
                f"{'GB' if expert_slots is None else 'slots'} holds no expert slot of {stride / 1e6:.3f} MB; "
                f"give at least {stride / 1e9:.6f} GB"
            )
        if num_slots > total:
            notes.append(f"the pool has {total} experts: the cache takes {total} slots, not {num_slots}")
            num_slots = total
        slot_delta = (num_slots - experts.num_slots) * stride
    if kv_gb is not None or kv_blocks is not None:
        kv = engine.kv
        num_kv_blocks = kv_blocks if kv_blocks is not None else _units_in_gb(_given(kv_gb), kv.bytes_per_block)
        needed = kv.blocks_for(engine.max_model_len)
        if num_kv_blocks < needed:
            raise ResizeRefused(
                f"a KV cache of {num_kv_blocks} blocks ({num_kv_blocks * kv.block_size} tokens) does not hold one "
                f"context of {engine.max_model_len} tokens (max_model_len): give at least "
                f"{(needed + 1) * kv.bytes_per_block / 1e9:.4f} GB ({needed} blocks)"
            )
        held = kv.num_blocks - engine.scheduler.prefix_cache.num_free
        if num_kv_blocks < held:
            raise ResizeRefused(
                f"running requests hold {held} KV blocks; a KV cache of {num_kv_blocks} blocks cannot keep them "
                "(retry when fewer requests run, or give more)"
            )
        if num_kv_blocks != kv.num_blocks:
            kv_peak = (num_kv_blocks + 1) * kv.bytes_per_block
    peak = kv_peak + max(0, slot_delta)
    headroom, bound = headroom_bytes(engine)
    if headroom is not None and peak > headroom:
        raise ResizeRefused(
            f"the resize needs {_gb_text(peak)} GB more at its peak (the new KV cache beside the old during its copy, "
            f"plus the expert cache's growth) and {bound} leaves {headroom / 1e9:.3f} GB; give smaller sizes"
        )
    return ResizePlan(num_slots, num_kv_blocks, peak, notes)


def _is_allocation_failure(exc: BaseException) -> bool:
    """An allocator's out-of-memory error: torch's on CUDA, a RuntimeError naming the allocation on the CPU."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "alloc" in str(exc).lower()
    )


def resize(
    engine: LLMEngine,
    expert_gb: float | None = None,
    kv_gb: float | None = None,
    expert_slots: int | None = None,
    kv_blocks: int | None = None,
) -> dict[str, Any]:
    """Resize the engine's caches now (call it between steps, on the thread that steps the engine).

    Args: as `plan_resize`.

    Returns:
        The answer of `POST /v1/cache/resize` (JSON-able): "before" and "after" (`cache_sizes`' expert_cache and
        kv_cache), "seconds", "notes"; also kept as `engine.last_resize`.

    Raises:
        ResizeRefused: from `plan_resize`; nothing was torn down.
        ResizeRolledBack: an allocation failed; both caches are back at their old sizes, and serving goes on.
    """
    t0 = time.perf_counter()
    plan = plan_resize(engine, expert_gb, kv_gb, expert_slots, kv_blocks)
    before = cache_sizes(engine)
    experts, kv, scheduler = _slot_cache(engine), engine.kv, engine.scheduler
    prefix = scheduler.prefix_cache
    engine.runner.release_decode()
    keep, layers = None, None
    try:
        if plan.num_kv_blocks is not None and plan.num_kv_blocks != kv.num_blocks:
            keep = prefix.keep_on_resize(plan.num_kv_blocks)
            layers = kv.allocate_layers(plan.num_kv_blocks, allocate_kv)
        if plan.num_slots is not None and experts is not None and plan.num_slots != experts.num_slots:
            experts.resize(plan.num_slots, allocate_slots)
    except Exception as exc:
        layers = None
        _rebuild_decode(engine)
        if not _is_allocation_failure(exc):
            raise
        log.warning("cache resize rolled back: %s", exc)
        raise ResizeRolledBack(
            f"an allocation failed during the resize ({str(exc).splitlines()[0]}); the expert cache and the KV cache "
            "are back at their old sizes and serving goes on; give smaller sizes"
        ) from exc
    if layers is not None:
        keep = _given(keep)  # set together with layers
        if engine.kv_host is not None:  # the host tier keeps what a shrink drops, copied before the old KV goes
            prefix.spill(keep)
            engine.kv_host.synchronize()
        kv.adopt(layers, keep)
        new_of = prefix.remap(keep)
        for seq in (*scheduler.running, *scheduler.paused, *scheduler.waiting):
            seq.block_table = [new_of[b] for b in seq.block_table]
        del layers
    notes = list(plan.notes)
    if not _rebuild_decode(engine):
        notes.append("the decode step's CUDA graphs could not be captured again; decode steps run eagerly")
    after = cache_sizes(engine)
    answer = {
        "before": {k: before[k] for k in ("expert_cache", "kv_cache")},
        "after": {k: after[k] for k in ("expert_cache", "kv_cache")},
        "seconds": round(time.perf_counter() - t0, 3),
        "notes": notes,
    }
    engine.num_resizes += 1
    engine.last_resize = answer
    slots = lambda sizes: None if sizes["expert_cache"] is None else sizes["expert_cache"]["num_slots"]
    log.info(
        "cache resize in %.2f s: expert slots %s -> %s, KV blocks %d -> %d",
        answer["seconds"],
        slots(before),
        slots(after),
        before["kv_cache"]["num_blocks"],
        after["kv_cache"]["num_blocks"],
    )
    return answer


def _rebuild_decode(engine: LLMEngine) -> bool:
    """Build the decode runner again; False (logged) when that fails, and decode steps then run eagerly."""
    try:
        engine.runner.build_decode()
    except Exception:
        log.exception("rebuilding the decode runner after a cache resize failed; decode steps run eagerly")
        engine.runner.decode = None
        return False
    return True
