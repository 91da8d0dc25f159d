"""The routed-expert path: the MoE layer asks an expert backend for the experts' outputs of its tokens.

`make_expert_backend` picks and builds the backend of `--moe-backend`: `fused` (every expert on the compute
device) or the expert cache (`offload`, `cpu`, `hybrid`: host pool + device slots, planned per layer step);
`auto` and `hybrid` read the bandwidth profile of `ft bench bw` (`freetoken.moe.profile`), measured at the first
start on a GPU that has none.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.moe.backend import ExpertBackend
from freetoken.moe.budget import plan_expert_slots
from freetoken.moe.fused import FusedExperts
from freetoken.moe.profile import ExpertShape, find_profile, planner_bandwidths, verdict

__all__ = ["ExpertBackend", "FusedExperts", "choose_backend", "make_expert_backend", "resolve_backend"]

log = logging.getLogger(__name__)


def gpu_uuid(device: torch.device) -> str:
    """The UUID of CUDA device `device` (`torch.cuda.get_device_properties(...).uuid`), the key of its profile."""
    return str(torch.cuda.get_device_properties(device).uuid)


def resolve_backend(name: str, device: torch.device) -> str:
    """`--moe-backend` -> the backend that runs, before any bandwidth profile is read: "auto" is "cpu" on a CPU
    device and "offload" on CUDA (`choose_backend` then makes it "hybrid" when the profile says so; both keep the
    experts in the host pool)."""
    if name != "auto":
        return name
    return "cpu" if device.type == "cpu" else "offload"


def choose_backend(
    name: str,
    device: torch.device,
    shape: ExpertShape,
    profiles: Path | None = None,
    measure: Callable[[], dict] | None = None,
) -> tuple[str, dict | None]:
    """`--moe-backend` -> (the backend that runs, the bandwidth profile it uses or None).

    "auto" is "cpu" on a CPU device; on CUDA it is "hybrid" when a usable profile of this GPU and expert shape
    (`freetoken.moe.profile.find_profile`, in `profiles` or the default directory) says so, else "offload".
    "hybrid" needs such a profile; "offload" and "cpu" take one when there is one (their stats then show measured
    against profiled bandwidths). When "auto" or "hybrid" finds no profile on CUDA and `measure` is given, it is
    called to measure and write one (`freetoken.bench.box.measure_profile`): without one, auto could only pick
    offload, never splitting misses with the CPU (14 against 46 tok/s on the lent H200 box at a 24 GB budget).
    Raises ValueError for "hybrid" without a profile or `measure`, saying to run `ft bench bw`.
    """
    if name == "fused" or device.type != "cuda":
        if name == "hybrid":
            raise ValueError("--moe-backend hybrid needs a GPU and its bandwidth profile; on a CPU device use cpu")
        return resolve_backend(name, device), None
    profile = find_profile(gpu_uuid(device), shape, profiles)
    if profile is None and measure is not None and name in ("auto", "hybrid"):
        profile = measure()
    if name == "hybrid" and profile is None:
        raise ValueError(
            f"--moe-backend hybrid needs a bandwidth profile of this GPU and expert {shape.label()}: run "
            "`ft bench bw --model DIR` first (or use --moe-backend offload)"
        )
    if name == "auto":
        name = verdict(*planner_bandwidths(profile))[0] if profile is not None else "offload"
        log.info("--moe-backend auto: %s (%s)", name, "from the bandwidth profile" if profile else "no profile")
    return name, profile


def _text_prefix(model_dir: Path, model_cfg: ModelConfig) -> str:
    """The prefix of the text model's tensors in the checkpoint in `model_dir` (`models.loader.text_prefix`)."""
    from freetoken.models.loader import CheckpointReader, TensorIndex, text_prefix

    return text_prefix(CheckpointReader(TensorIndex.scan(Path(model_dir))), model_cfg)


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
        ValueError: an unknown backend, `hybrid` without a bandwidth profile (says to run `ft bench bw`), or a
            budget that leaves no room for expert slots (names the flags).
        freetoken._core.CheckpointError / MissingFileError: the pool cannot read the checkpoint.
    """
    device = torch.device(cfg.device)
    shape = ExpertShape(model_cfg.hidden_size, model_cfg.moe_intermediate_size)
    measure = None
    if device.type == "cuda" and not cfg.no_auto_profile:
        from freetoken.bench.box import measure_profile

        index = device.index if device.index is not None else torch.cuda.current_device()
        measure = functools.partial(measure_profile, shape, model_cfg, index, cpu_threads=cfg.cpu_threads)
    name, profile = choose_backend(cfg.moe_backend, device, shape, measure=measure)
    if name == "fused":
        if cfg.prefill_strategy != "auto" or cfg.no_prefill_overlap:
            log.warning("--prefill-strategy / --no-prefill-overlap: ignored, --moe-backend fused keeps every expert")
        return FusedExperts()
    if cfg.no_prefill_overlap and cfg.prefill_strategy in ("fill", "cpu", "hybrid"):
        log.warning("--no-prefill-overlap: ignored, --prefill-strategy %s streams no layers", cfg.prefill_strategy)
    from freetoken._core import CheckpointError, ExpertPool
    from freetoken.moe.expert_cache import ExpertCacheBackend

    sizes = (model_cfg.num_experts, model_cfg.hidden_size, model_cfg.moe_intermediate_size)
    layers = model_cfg.moe_layers
    if model_dir is None:
        pool = ExpertPool.random(len(layers), *sizes, seed=cfg.seed, moe_layers=layers)
    elif not model_cfg.is_qwen3_5 or _text_prefix(model_dir, model_cfg) == "model.":
        pool = ExpertPool.from_checkpoint(model_dir)
        if list(pool.moe_layers) != model_cfg.moe_layers:  # the Rust reader applies the rule too: they must agree
            raise CheckpointError(
                f"{model_dir}: the expert pool found MoE layers {list(pool.moe_layers)}, the model config "
                f"{model_cfg.moe_layers} (`ModelConfig.is_moe_layer`)"
            )
    else:  # the Rust loader reads `model.layers.*` names only: the pool's shape from it, the experts from Python
        from freetoken.models.loader import fill_expert_pool

        pool = ExpertPool.random(len(layers), *sizes, seed=cfg.seed, moe_layers=layers)
        fill_expert_pool(pool, model_dir, model_cfg)
    num_slots, layer_buffers = plan_expert_slots(cfg, model_cfg, dtype, pool.expert_stride, name)
    log.info(
        "expert cache (%s): %d slots x %.1f MB = %.2f GB, %.0f%% of the %.1f GB pool; prefill: %s",
        name,
        num_slots,
        pool.expert_stride / 1e6,
        num_slots * pool.expert_stride / 1e9,
        100 * num_slots / (pool.num_layers * pool.num_experts),
        pool.nbytes / 1e9,
        f"{layer_buffers} layer buffer(s) for streaming, strategy {cfg.prefill_strategy}"
        if layer_buffers
        else f"on demand ({cfg.prefill_strategy})",
    )
    if name == "cpu" and cfg.expert_slots:
        log.warning("--expert-slots %d: ignored, --moe-backend cpu keeps no expert slots", cfg.expert_slots)
    pcie_bytes_per_s, cpu_bytes_per_s = planner_bandwidths(profile) if profile is not None else (None, None)
    backend = ExpertCacheBackend(
        name,
        pool,
        device,
        num_slots,
        policy=cfg.expert_cache_policy,
        pcie_bytes_per_s=pcie_bytes_per_s,
        cpu_bytes_per_s=cpu_bytes_per_s,
        cpu_threads=cfg.cpu_threads or None,
        layer_buffers=layer_buffers,
        prefill_strategy=cfg.prefill_strategy,
    )
    log.info("host expert kernels: %d threads (%s)", backend.cpu.num_threads, backend.cpu.isa)
    return backend
