"""The routed-expert path: the MoE layer asks an expert backend for the experts' outputs of its tokens.

`make_expert_backend` picks and builds the backend of `--moe-backend`: `fused` (every expert on the compute
device) or the expert cache (`offload`, `cpu`, `hybrid`: host pool + device slots, planned per layer step).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.moe.backend import ExpertBackend
from freetoken.moe.budget import plan_expert_slots
from freetoken.moe.fused import FusedExperts

__all__ = ["ExpertBackend", "FusedExperts", "make_expert_backend", "resolve_backend"]

log = logging.getLogger(__name__)


def resolve_backend(name: str, device: torch.device) -> str:
    """`--moe-backend` -> the backend that runs: "auto" is "cpu" on a CPU device and "offload" on CUDA."""
    if name != "auto":
        return name
    return "cpu" if device.type == "cpu" else "offload"


def make_expert_backend(
    cfg: EngineConfig, model_cfg: ModelConfig, model_dir: Path | None, dtype: torch.dtype
) -> ExpertBackend:
    """Build the expert backend of `cfg.moe_backend` for `model_cfg`.

    Args:
        cfg: engine settings (backend, device, budget, slots, policy, seed).
        model_cfg: the model.
        model_dir: checkpoint to read the experts from; None builds seeded random experts (`--dummy-weights`).
        dtype: the model's compute dtype.

    Raises:
        ValueError: an unknown backend, or a budget that leaves no room for expert slots (names the flags).
        freetoken._core.CheckpointError / MissingFileError: the pool cannot read the checkpoint.
    """
    device = torch.device(cfg.device)
    name = resolve_backend(cfg.moe_backend, device)
    if name == "fused":
        return FusedExperts()
    from freetoken._core import ExpertPool
    from freetoken.moe.expert_cache import ExpertCacheBackend

    if model_dir is None:
        pool = ExpertPool.random(
            len(model_cfg.moe_layers),
            model_cfg.num_experts,
            model_cfg.hidden_size,
            model_cfg.moe_intermediate_size,
            seed=cfg.seed,
            moe_layers=model_cfg.moe_layers,
        )
    else:
        pool = ExpertPool.from_checkpoint(model_dir)
    num_slots = cfg.expert_slots or plan_expert_slots(cfg, model_cfg, dtype, pool.expert_stride, name)
    log.info(
        "expert cache (%s): %d slots x %.1f MB = %.2f GB, %.0f%% of the %.1f GB pool",
        name,
        num_slots,
        pool.expert_stride / 1e6,
        num_slots * pool.expert_stride / 1e9,
        100 * num_slots / (pool.num_layers * pool.num_experts),
        pool.nbytes / 1e9,
    )
    return ExpertCacheBackend(
        name,
        pool,
        device,
        num_slots,
        policy=cfg.expert_cache_policy,
        cpu_threads=cfg.cpu_threads or None,
    )
