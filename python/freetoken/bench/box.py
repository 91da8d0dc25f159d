"""Measure this box: every bandwidth of `freetoken.bench.bandwidth` in one run, and the profile q* reads, with each
quantized expert format's own kernel and copy rates beside bf16's.

`measure_box` is the whole measurement behind `ft bench bw` (which prints it) and behind `ft serve`'s first start
on a GPU that has no profile yet (`measure_profile`, which writes one so later starts read it). The profile's
schema is `freetoken.moe.profile`'s.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken.config import ModelConfig
from freetoken.moe.profile import ExpertShape
from freetoken.quant.formats import ExpertFormat, QuantConfigError, format_named, quant_spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PathRates:
    """One expert format's two miss paths on one GPU (bytes/s of its expert bytes): expert copies alone, and for
    each batch b the (PCIe, CPU) pair measured overlapped; `planner_pcie` and `planner_cpu` are what q* uses
    (`planner_figures`)."""

    pcie: float
    overlapped: dict[int, tuple[float, float]]
    planner_pcie: float
    planner_cpu: dict[int, float]


@dataclass(frozen=True)
class GpuRun(PathRates):
    """One GPU's figures: the bf16 experts' paths, and the copies that do not depend on the format (bytes/s): the
    plain torch copy of an expert's size and the line rate; `info` is `gpu_info`'s."""

    info: dict[str, Any]
    torch_copy: float
    line_rate: float


@dataclass(frozen=True)
class FormatRun:
    """A quantized expert format's own figures (bytes/s of its expert bytes, weights and scales): its host kernel
    alone at each batch b, and its paths on each measured GPU (by CUDA index), measured as bf16's are."""

    name: str
    block: tuple[int, int] | None
    expert_nbytes: int
    cpu_alone: dict[int, float]
    gpus: dict[int, PathRates]

    def profile_entry(self, index: int) -> dict[str, Any]:
        """The format's entry under the profile's "formats" for GPU `index` (`freetoken.moe.profile`'s schema)."""
        paths = self.gpus[index]
        return {
            "expert_nbytes": self.expert_nbytes,
            "block": list(self.block) if self.block else None,
            "measured": {
                "pcie_expert_bytes_per_s": paths.pcie,
                "cpu_bytes_per_s": {str(b): v for b, v in self.cpu_alone.items()},
                "overlapped": {
                    "pcie_bytes_per_s": {str(b): p for b, (p, _) in paths.overlapped.items()},
                    "cpu_bytes_per_s": {str(b): c for b, (_, c) in paths.overlapped.items()},
                },
            },
            "planner": {
                "pcie_bytes_per_s": paths.planner_pcie,
                "cpu_bytes_per_s": {str(b): c for b, c in paths.planner_cpu.items()},
            },
        }


@dataclass(frozen=True)
class BoxRun:
    """A whole run: the host (`host_info`), how it was measured, the host ceilings and bf16 kernel rates alone
    (bytes/s by batch b), each measured GPU, and each quantized format measured (by `ExpertFormat.name`)."""

    host: dict[str, Any]
    method: dict[str, Any]
    host_read: float
    cpu_alone: dict[int, float]
    gpus: list[GpuRun]
    formats: dict[str, FormatRun] = field(default_factory=dict)


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


def format_for(cfg: ModelConfig, shape: ExpertShape, name: str) -> ExpertFormat:
    """The expert format `measure_box` measures as `name` (an `ExpertFormat.name`) for model `cfg`'s experts of
    `shape`: FP8 blocks of the model's own `weight_block_size` where its checkpoint is FP8, else 128 x 128 (Qwen's
    and DeepSeek-V3's releases); the other formats as `format_named` gives them.

    Raises:
        QuantConfigError: an unknown name, or a format that cannot split `shape` into whole blocks (names the
            format, the size and the block).
    """
    block = (128, 128)
    if name == "fp8_block":
        try:
            own = quant_spec(cfg.raw, cfg.model_dir).format
        except QuantConfigError:  # a checkpoint freetoken cannot serve still has shapes to measure
            own = None
        if own is not None and own.name == "fp8_block":
            block = (own.block_rows, own.block_cols)
    fmt = format_named(name, block)
    fmt.check_shape(shape.hidden_size, shape.intermediate_size, source=f"{name} experts")
    return fmt


def measure_box(
    shape: ExpertShape,
    cfg: ModelConfig,
    experts_per_call: int,
    gpu_indices: Iterable[int],
    *,
    seconds: float = 1.0,
    pool_gb: float = 6.0,
    cpu_threads: int = 0,
    formats: Iterable[str] = (),
) -> BoxRun:
    """Run every measurement on a random pool of `pool_gb` GB of `shape` experts, with a rich progress line on
    stderr: the host memory read and the host kernel at each batch of `BATCHES` alone, then, on each GPU of
    `gpu_indices`, expert copies, the torch reference copy, the line rate and both paths overlapped. Then, for each
    quantized format of `formats`, a random pool of as many experts in that format, measured the same way through
    its own `CpuExperts` (its quantized kernels): host kernel alone, expert copies, both paths overlapped.

    Args:
        shape: the expert shape (only shapes matter: weights are random).
        cfg: the model (its MoE layers and experts per layer lay out the pool).
        experts_per_call: experts per host-kernel call (the model's top-k).
        gpu_indices: CUDA devices to measure; empty measures the host side only.
        seconds: length of each timed measurement.
        pool_gb: the pool's size, far larger than the LLC so weights stream from DRAM.
        cpu_threads: threads of the host kernel; 0 is all CPUs.
        formats: quantized formats (`ExpertFormat.name`: fp8_block, nvfp4, mxfp4; as `format_for` gives them)
            measured besides bf16, which is always measured (the profile's top-level figures are its); "bf16" is
            ignored.

    Raises:
        QuantConfigError: a format of `formats` that cannot split the expert sizes (`format_for`), before anything
            is measured.
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
    chosen = {name: format_for(cfg, shape, name) for name in dict.fromkeys(formats) if name != "bf16"}
    num_experts = max(experts_per_call, round(pool_gb * 1e9 / shape.expert_nbytes))
    num_layers = max(1, min(len(cfg.moe_layers), num_experts // cfg.num_experts))
    per_layer = min(cfg.num_experts, num_experts) if num_layers == 1 else cfg.num_experts
    per_format = len(BATCHES) + len(gpu_indices) * (1 + len(BATCHES))
    phases = 1 + per_format + len(gpu_indices) * 2 + len(chosen) * (1 + per_format)
    t_start = time.perf_counter()
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=stderr_console(), transient=True
    ) as progress:
        task = progress.add_task("building the expert pool", total=phases)

        def phase(description: str) -> None:
            progress.update(task, description=description, advance=1)

        def kernel_and_paths(
            pool: ExpertPool, cpu: CpuExperts, label: str, extra: Callable[[int, torch.device], None] | None = None
        ) -> tuple[dict[int, float], dict[int, PathRates]]:
            """The host kernel of `pool` alone at each b, then on each GPU its expert copies alone and both paths
            overlapped at each b (`extra(i, device)` runs after the copies, with the pool pinned)."""
            alone = {}
            for b in BATCHES:
                phase(f"{label}host kernel, b={b}")
                alone[b] = bw.measure_cpu(cpu, pool, b, experts_per_call, seconds)
            paths: dict[int, Any] = {}
            if not gpu_indices:
                return alone, paths
            arena = torch.frombuffer(pool.arena_view(), dtype=torch.uint8)
            pinned = PinnedRegion(pool.ptr, pool.nbytes, keep=pool)  # registered while measuring
            for i in gpu_indices:
                device = torch.device("cuda", i)
                torch.cuda.set_device(device)
                stream = torch.cuda.Stream(device)
                slots = torch.empty(64, pool.expert_stride, dtype=torch.uint8, device=device)
                phase(f"cuda:{i} {label}PCIe expert copies")
                pcie = bw.measure_pcie(pool, arena, slots, stream, seconds)
                if extra is not None:
                    extra(i, device)
                overlapped = {}
                for b in BATCHES:
                    phase(f"cuda:{i} {label}overlapped, b={b}")
                    overlapped[b] = bw.measure_overlapped(cpu, pool, arena, slots, stream, b, experts_per_call, seconds)
                paths[i] = PathRates(pcie, overlapped, *bw.planner_figures(overlapped))
                del slots
            del arena, pinned  # unregistered before the pool can go
            return alone, paths

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
        references: dict[int, tuple[float, float]] = {}

        def reference_copies(i: int, device: torch.device) -> None:
            phase(f"cuda:{i} plain torch pinned copies")
            torch_copy = bw.measure_torch_copy(pool.expert_nbytes, device, seconds)
            phase(f"cuda:{i} PCIe line rate")
            references[i] = (torch_copy, bw.measure_line_rate(device))

        cpu_alone, paths = kernel_and_paths(pool, cpu, "", reference_copies)
        gpus = [
            GpuRun(p.pcie, p.overlapped, p.planner_pcie, p.planner_cpu, gpu_info(i), *references[i])
            for i, p in paths.items()
        ]
        measured = {}
        for fmt, spec in chosen.items():
            phase(f"building the {fmt} expert pool")
            block = (spec.block_rows, spec.block_cols) if fmt == "fp8_block" else None
            qpool = ExpertPool.random(
                num_layers, per_layer, shape.hidden_size, shape.intermediate_size, seed=0, format=fmt,
                block=block or (0, 0),
            )  # fmt: skip
            qcpu = CpuExperts(qpool, num_threads=cpu.num_threads)
            q_alone, q_paths = kernel_and_paths(qpool, qcpu, f"{fmt} ")
            measured[fmt] = FormatRun(fmt, block, qpool.expert_nbytes, q_alone, q_paths)
            del qcpu, qpool  # its workers exit before the next format's start
    log.info("measured in %.0f s", time.perf_counter() - t_start)
    return BoxRun(host_info(cpu.num_threads, cpu.isa), method, host_read, cpu_alone, gpus, measured)


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
        "formats": {name: f.profile_entry(gpu.info["index"]) for name, f in run.formats.items()},
    }


# `ft serve`'s own measurement on first start: shorter than `ft bench bw`'s defaults (1 s each, 6 GB), which the
# profile's `method` records; the planner's online refinement corrects B_pcie and B_cpu as it serves anyway.
SERVE_SECONDS = 0.5
SERVE_POOL_GB = 4.0


def measure_profile(
    shape: ExpertShape,
    cfg: ModelConfig,
    device_index: int,
    directory: Path | None = None,
    cpu_threads: int = 0,
    formats: Iterable[str] = (),
) -> dict[str, Any]:
    """Measure GPU `device_index` and the host for `shape` (about 10 s, and about 4 s more per quantized format of
    `formats`: the served model's), write the profile where `freetoken.moe.profile.find_profile` looks
    (`directory`, default `profile_dir()`), and return it.

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
        cpu_threads=cpu_threads, formats=formats,
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
