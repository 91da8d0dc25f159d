"""Measure this box: every bandwidth of `freetoken.bench.bandwidth` in one run, and the profile q* reads.

`measure_box` is the whole measurement behind `ft bench bw` (which prints it) and behind `ft serve`'s first start
on a GPU that has no profile yet (`measure_profile`, which writes one so later starts read it). The profile's
schema is `freetoken.moe.profile`'s.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.config import ModelConfig
from freetoken.moe.profile import ExpertShape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuRun:
    """One GPU's figures (bytes/s): expert copies, the plain torch copy, the line rate, and for each batch b the
    (PCIe, CPU) pair measured overlapped; `planner_pcie` and `planner_cpu` are what q* uses (`planner_figures`)."""

    info: dict[str, Any]
    pcie: float
    torch_copy: float
    line_rate: float
    overlapped: dict[int, tuple[float, float]]
    planner_pcie: float
    planner_cpu: dict[int, float]


@dataclass(frozen=True)
class BoxRun:
    """A whole run: the host (`host_info`), how it was measured, the host ceilings and kernel rates alone (bytes/s
    by batch b), and each measured GPU."""

    host: dict[str, Any]
    method: dict[str, Any]
    host_read: float
    cpu_alone: dict[int, float]
    gpus: list[GpuRun]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def host_info(kernel_threads: int, isa: str) -> dict[str, Any]:
    """CPU model (/proc/cpuinfo), logical CPUs, and the host kernel's threads and ISA."""
    model = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo") or "", re.MULTILINE)
    return {
        "cpu_model": model.group(1) if model else None,
        "num_cpus": os.cpu_count(),
        "kernel_threads": kernel_threads,
        "isa": isa,
    }


def nvidia_driver_version(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version's text ("NVRM version: NVIDIA UNIX [Open] Kernel Module
    [for x86_64]  580.159.03  Release Build ..."), or None."""
    match = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)*)\s", text)
    return match.group(1) if match else None


def gpu_info(index: int) -> dict[str, Any]:
    """Name, UUID, CUDA runtime, driver (/proc/driver/nvidia/version) and PCIe link (sysfs, by the device's PCI
    bus id) of CUDA device `index`; what cannot be read is null."""
    import torch

    props = torch.cuda.get_device_properties(index)
    pci: list[Any] = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]  # torch >= 2.5
    bus_id = None if None in pci else "{:04x}:{:02x}:{:02x}.0".format(*pci)
    keys = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
    link = {k: _read(f"/sys/bus/pci/devices/{bus_id}/{k}") if bus_id else None for k in keys}
    driver = nvidia_driver_version(_read("/proc/driver/nvidia/version") or "")
    return {
        "uuid": str(props.uuid),
        "name": props.name,
        "index": index,
        "cuda_runtime": torch.version.cuda,
        "driver": driver,
        "pci_bus_id": bus_id,
        "pcie_link": link if any(link.values()) else None,
        "total_memory_bytes": props.total_memory,
    }


def measure_box(
    shape: ExpertShape,
    cfg: ModelConfig,
    experts_per_call: int,
    gpu_indices: Iterable[int],
    *,
    seconds: float = 1.0,
    pool_gb: float = 6.0,
    cpu_threads: int = 0,
) -> BoxRun:
    """Run every measurement on a random pool of `pool_gb` GB of `shape` experts, with a rich progress line on
    stderr: the host memory read and the host kernel at each batch of `BATCHES` alone, then, on each GPU of
    `gpu_indices`, expert copies, the torch reference copy, the line rate and both paths overlapped.

    Args:
        shape: the expert shape (only shapes matter: weights are random).
        cfg: the model (its MoE layers and experts per layer lay out the pool).
        experts_per_call: experts per host-kernel call (the model's top-k).
        gpu_indices: CUDA devices to measure; empty measures the host side only.
        seconds: length of each timed measurement.
        pool_gb: the pool's size, far larger than the LLC so weights stream from DRAM.
        cpu_threads: threads of the host kernel; 0 is all CPUs.

    Raises:
        torch.cuda.OutOfMemoryError / RuntimeError: the pool cannot be built or pinned.
    """
    import torch
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from freetoken._core import CpuExperts, ExpertPool
    from freetoken.bench import bandwidth as bw
    from freetoken.cli.logs import stderr_console
    from freetoken.moe.pinned import PinnedRegion
    from freetoken.moe.profile import BATCHES

    gpu_indices = list(gpu_indices)
    num_experts = max(experts_per_call, round(pool_gb * 1e9 / shape.expert_nbytes))
    num_layers = max(1, min(len(cfg.moe_layers), num_experts // cfg.num_experts))
    per_layer = min(cfg.num_experts, num_experts) if num_layers == 1 else cfg.num_experts
    phases = 1 + len(BATCHES) + len(gpu_indices) * (3 + len(BATCHES))
    t_start = time.perf_counter()
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=stderr_console(), transient=True
    ) as progress:
        task = progress.add_task("building the expert pool", total=phases)

        def phase(description: str) -> None:
            progress.update(task, description=description, advance=1)

        pool = ExpertPool.random(num_layers, per_layer, shape.hidden_size, shape.intermediate_size, seed=0)
        cpu = CpuExperts(pool, num_threads=cpu_threads or None)
        method = {
            "pool_bytes": pool.nbytes,
            "seconds_per_measurement": seconds,
            "experts_per_call": min(experts_per_call, per_layer),
            "batches": list(BATCHES),
        }
        phase("host memory read")
        host_read = bw.measure_host_read(pool, cpu.num_threads)
        cpu_alone = {}
        for b in BATCHES:
            phase(f"host kernel, b={b}")
            cpu_alone[b] = bw.measure_cpu(cpu, pool, b, experts_per_call, seconds)
        gpus = []
        if gpu_indices:
            arena = torch.frombuffer(pool.arena_view(), dtype=torch.uint8)
            _pinned = PinnedRegion(pool.ptr, pool.nbytes, keep=pool)  # registered while measuring
        for i in gpu_indices:
            device = torch.device("cuda", i)
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
            slots = torch.empty(64, pool.expert_stride, dtype=torch.uint8, device=device)
            phase(f"cuda:{i} PCIe expert copies")
            pcie = bw.measure_pcie(pool, arena, slots, stream, seconds)
            phase(f"cuda:{i} plain torch pinned copies")
            torch_copy = bw.measure_torch_copy(pool.expert_nbytes, device, seconds)
            phase(f"cuda:{i} PCIe line rate")
            line = bw.measure_line_rate(device)
            overlapped = {}
            for b in BATCHES:
                phase(f"cuda:{i} overlapped, b={b}")
                overlapped[b] = bw.measure_overlapped(cpu, pool, arena, slots, stream, b, experts_per_call, seconds)
            planner_pcie, planner_cpu = bw.planner_figures(overlapped)
            gpus.append(GpuRun(gpu_info(i), pcie, torch_copy, line, overlapped, planner_pcie, planner_cpu))
            del slots
    log.info("measured in %.0f s", time.perf_counter() - t_start)
    return BoxRun(host_info(cpu.num_threads, cpu.isa), method, host_read, cpu_alone, gpus)


def build_profile(run: BoxRun, gpu: GpuRun, shape: ExpertShape) -> dict[str, Any]:
    """The profile of one measured GPU, in `freetoken.moe.profile`'s schema (`SCHEMA_VERSION`)."""
    from freetoken import __version__
    from freetoken.moe.profile import HYBRID_MIN_Q_STAR, SCHEMA_VERSION, verdict

    backend, q1 = verdict(gpu.planner_pcie, gpu.planner_cpu)
    return {
        "schema_version": SCHEMA_VERSION,
        "freetoken_version": __version__,
        "created_unix_s": time.time(),
        "gpu": gpu.info,
        "host": run.host,
        "expert": shape.to_dict(),
        "method": run.method,
        "measured": {
            "pcie_expert_bytes_per_s": gpu.pcie,
            "pcie_torch_copy_bytes_per_s": gpu.torch_copy,
            "pcie_line_rate_bytes_per_s": gpu.line_rate,
            "cpu_bytes_per_s": {str(b): v for b, v in run.cpu_alone.items()},
            "host_read_bytes_per_s": run.host_read,
            "overlapped": {
                "pcie_bytes_per_s": {str(b): p for b, (p, _) in gpu.overlapped.items()},
                "cpu_bytes_per_s": {str(b): c for b, (_, c) in gpu.overlapped.items()},
            },
        },
        "planner": {
            "pcie_bytes_per_s": gpu.planner_pcie,
            "cpu_bytes_per_s": {str(b): c for b, c in gpu.planner_cpu.items()},
        },
        "verdict": {"backend": backend, "q_star_b1": q1, "hybrid_min_q_star": HYBRID_MIN_Q_STAR},
    }


# `ft serve`'s own measurement on first start: shorter than `ft bench bw`'s defaults (1 s each, 6 GB), which the
# profile's `method` records; the planner's online refinement corrects B_pcie and B_cpu as it serves anyway.
SERVE_SECONDS = 0.5
SERVE_POOL_GB = 4.0


def measure_profile(
    shape: ExpertShape, cfg: ModelConfig, device_index: int, directory: Path | None = None, cpu_threads: int = 0
) -> dict[str, Any]:
    """Measure GPU `device_index` and the host for `shape` (about 10 s), write the profile where
    `freetoken.moe.profile.find_profile` looks (`directory`, default `profile_dir()`), and return it.

    A profile that cannot be written (an unwritable or full `directory`: OSError) is logged as a warning and still
    returned: this start runs on the measured figures, and the next one measures again.
    """
    from freetoken.moe.profile import profile_dir, profile_path, write_profile

    log.info(
        "measuring this box for the expert-miss planner (once per GPU and expert shape, about 10 s; "
        "`ft bench bw` measures longer and prints the figures; --no-auto-profile skips this)",
    )
    run = measure_box(
        shape, cfg, cfg.num_experts_per_tok, [device_index], seconds=SERVE_SECONDS, pool_gb=SERVE_POOL_GB,
        cpu_threads=cpu_threads,
    )  # fmt: skip
    profile = build_profile(run, run.gpus[0], shape)
    path = profile_path(profile_dir() if directory is None else directory, run.gpus[0].info["uuid"], shape)
    try:
        write_profile(path, profile)
    except OSError as exc:
        log.warning(
            "could not write the bandwidth profile to %s (%s): this run uses the measured figures, the next start "
            "measures again (set FREETOKEN_PROFILE_DIR to a writable directory, or run `ft bench bw`)",
            path,
            exc,
        )
    else:
        log.info("bandwidth profile written to %s", path)
    return profile
