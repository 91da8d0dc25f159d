"""`ft bench bw`: measure this box's two expert-miss paths and write the bandwidth profile q* reads."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from freetoken.cli.serve import DEMO
from freetoken.config import ModelConfig

log = logging.getLogger("freetoken.cli")

DEFAULT_PRESET = "qwen3-30b-a3b"

BW_DESCRIPTION = f"""\
Measure, on this box and the model's expert shape, the two ways an expert-cache miss is served, and write one
bandwidth profile per GPU (JSON, keyed by GPU UUID and expert shape) that `ft serve --moe-backend auto|hybrid`
reads. Weights are random (only the shapes matter); the pool is --pool-gb of experts, far larger than the LLC.

Methods (all figures GB/s = 1e9 bytes/s of expert weights):
  PCIe expert copy     whole experts, pinned pool -> GPU slots, on a copy stream, timed by CUDA events
  PCIe torch copy      the same size the plain torch way (pin_memory tensor -> device tensor): the reference
  PCIe line rate       one 1 GiB linear pinned copy, best of 3: the ceiling
  host kernel b        the Rust CPU expert kernel, top-k experts per call, b tokens each, calls walking the pool
  host memory read     a torch sum over the pool on the kernel's threads, best of 3: the ceiling
  overlapped           copies kept queued on the copy stream while the kernel runs at each b: both at once, as
                       a hybrid decode step does; these figures are what q* uses
Verdict: hybrid when q*(b=1) = B_cpu(1) / (B_cpu(1) + B_pcie) >= 0.15 (below, the saved miss time does not pay
for CPU runs buying no future hits), else offload.

Shapes: --model DIR (its config.json), --preset NAME, or {DEFAULT_PRESET}. Profiles go to --out, else
$FREETOKEN_PROFILE_DIR, else $XDG_CACHE_HOME/freetoken/profiles. Without a GPU only the host side is measured
and no profile is written. Every visible GPU gets its own profile (restrict with CUDA_VISIBLE_DEVICES).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `ft bench` and its flags to the subcommands of `ft` (`freetoken.cli.main.build_parser`)."""
    from freetoken.models.presets import preset_names

    p = sub.add_parser("bench", help="measure this box", description="Measurements of this box.")
    verbs = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    bw = verbs.add_parser(
        "bw",
        help="PCIe and host expert-kernel bandwidths; writes the q* profile",
        description=BW_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = bw.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        type=Path,
        help="model directory, or 'demo' as ft serve takes it: expert shape and top-k from its config.json",
    )
    source.add_argument(
        "--preset", choices=preset_names(), help=f"a shipped real config (default: {DEFAULT_PRESET})"
    )
    bw.add_argument("--seconds", type=float, default=1.0, help="length of each timed measurement, s (default: 1)")
    bw.add_argument("--pool-gb", type=float, default=6.0, help="random expert pool (working set), GB (default: 6)")
    bw.add_argument("--cpu-threads", type=int, default=0, help="threads of the host expert kernel; 0 = all CPUs")
    bw.add_argument(
        "--experts-per-call",
        type=int,
        default=0,
        help="experts per host-kernel call; 0 = the model's top-k (as the criterion bench; a decode step at batch 1 "
        "sends fewer, and the online refinement corrects B_cpu for it)",
    )
    bw.add_argument("--out", type=Path, default=None, help="directory of the profiles (default: see above)")
    bw.set_defaults(func=run_bw, parser=bw)


def _model_config(args: argparse.Namespace) -> ModelConfig:
    if args.model is not None:
        if str(args.model) == DEMO and not args.model.exists():
            from freetoken.models.demo import demo_checkpoint_dir

            return ModelConfig.from_dir(demo_checkpoint_dir())
        return ModelConfig.from_dir(args.model)
    from freetoken.models.presets import preset_config_path

    name = args.preset or DEFAULT_PRESET
    return ModelConfig.from_dict(json.loads(preset_config_path(name).read_text()), source=name)


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
    pci = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]  # torch >= 2.5
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


def run_bw(args: argparse.Namespace) -> int:
    """Measure, print the table and verdict, write one profile per GPU (none without a GPU)."""
    if args.seconds <= 0 or args.pool_gb <= 0 or args.cpu_threads < 0 or args.experts_per_call < 0:
        raise ValueError("--seconds and --pool-gb must be > 0, --cpu-threads and --experts-per-call >= 0")
    cfg = _model_config(args)
    import torch
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from freetoken import __version__
    from freetoken._core import CpuExperts, ExpertPool
    from freetoken.bench import bandwidth as bw
    from freetoken.cli.logs import stderr_console
    from freetoken.moe.pinned import pin_host_memory
    from freetoken.moe.profile import (
        BATCHES, HYBRID_MIN_Q_STAR, SCHEMA_VERSION, ExpertShape, profile_dir, profile_path, verdict, write_profile,
    )  # fmt: skip

    shape = ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size)
    experts_per_call = args.experts_per_call or cfg.num_experts_per_tok
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    num_experts = max(experts_per_call, round(args.pool_gb * 1e9 / shape.expert_nbytes))
    num_layers = max(1, min(len(cfg.moe_layers), num_experts // cfg.num_experts))
    per_layer = min(cfg.num_experts, num_experts) if num_layers == 1 else cfg.num_experts
    phases = 1 + len(BATCHES) + num_gpus * (3 + len(BATCHES))
    t_start = time.perf_counter()
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=stderr_console(), transient=True
    ) as progress:
        task = progress.add_task("building the expert pool", total=phases)

        def phase(description: str) -> None:
            progress.update(task, description=description, advance=1)

        pool = ExpertPool.random(num_layers, per_layer, shape.hidden_size, shape.intermediate_size, seed=0)
        cpu = CpuExperts(pool, num_threads=args.cpu_threads or None)
        method = {
            "pool_bytes": pool.nbytes,
            "seconds_per_measurement": args.seconds,
            "experts_per_call": min(experts_per_call, per_layer),
            "batches": list(BATCHES),
        }
        phase("host memory read")
        host_read = bw.measure_host_read(pool, cpu.num_threads)
        cpu_alone = {}
        for b in BATCHES:
            phase(f"host kernel, b={b}")
            cpu_alone[b] = bw.measure_cpu(cpu, pool, b, experts_per_call, args.seconds)
        gpus = []
        if num_gpus:
            arena = torch.frombuffer(pool.arena_view(), dtype=torch.uint8)
            pin_host_memory(pool.ptr, pool.nbytes)
        for i in range(num_gpus):
            device = torch.device("cuda", i)
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)
            slots = torch.empty(64, pool.expert_stride, dtype=torch.uint8, device=device)
            phase(f"cuda:{i} PCIe expert copies")
            pcie = bw.measure_pcie(pool, arena, slots, stream, args.seconds)
            phase(f"cuda:{i} plain torch pinned copies")
            torch_copy = bw.measure_torch_copy(pool.expert_nbytes, device, args.seconds)
            phase(f"cuda:{i} PCIe line rate")
            line = bw.measure_line_rate(device)
            overlapped = {}
            for b in BATCHES:
                phase(f"cuda:{i} overlapped, b={b}")
                overlapped[b] = bw.measure_overlapped(cpu, pool, arena, slots, stream, b, experts_per_call, args.seconds)
            gpus.append((gpu_info(i), pcie, torch_copy, line, overlapped))
            del slots
    log.info("measured in %.0f s", time.perf_counter() - t_start)

    console = Console(no_color="NO_COLOR" in os.environ)
    host = host_info(cpu.num_threads, cpu.isa)
    if not gpus:
        _table(console, shape, host, host_read, cpu_alone, None)
        console.print("no CUDA GPU present: measured the host side only; no profile written")
        return 0
    directory = args.out if args.out is not None else profile_dir()
    for gpu, pcie, torch_copy, line, overlapped in gpus:
        planner_pcie, planner_cpu = bw.planner_figures(overlapped)
        backend, q1 = verdict(planner_pcie, planner_cpu)
        profile = {
            "schema_version": SCHEMA_VERSION,
            "freetoken_version": __version__,
            "created_unix_s": time.time(),
            "gpu": gpu,
            "host": host,
            "expert": shape.to_dict(),
            "method": method,
            "measured": {
                "pcie_expert_bytes_per_s": pcie,
                "pcie_torch_copy_bytes_per_s": torch_copy,
                "pcie_line_rate_bytes_per_s": line,
                "cpu_bytes_per_s": {str(b): v for b, v in cpu_alone.items()},
                "host_read_bytes_per_s": host_read,
                "overlapped": {
                    "pcie_bytes_per_s": {str(b): p for b, (p, _) in overlapped.items()},
                    "cpu_bytes_per_s": {str(b): c for b, (_, c) in overlapped.items()},
                },
            },
            "planner": {"pcie_bytes_per_s": planner_pcie, "cpu_bytes_per_s": {str(b): c for b, c in planner_cpu.items()}},
            "verdict": {"backend": backend, "q_star_b1": q1, "hybrid_min_q_star": HYBRID_MIN_Q_STAR},
        }
        _table(console, shape, host, host_read, cpu_alone, (gpu, pcie, torch_copy, line, overlapped))
        path = profile_path(directory, gpu["uuid"], shape)
        write_profile(path, profile)
        console.print(
            f"cuda:{gpu['index']} verdict: [bold]{backend}[/bold], q*(b=1) = {q1:.2f} "
            f"({'>=' if backend == 'hybrid' else '<'} {HYBRID_MIN_Q_STAR}); profile written to {path}"
        )
    return 0


def _table(console, shape, host, host_read, cpu_alone, gpu) -> None:
    """The run as a rich table, GB/s alone and overlapped (the methods are in `ft bench bw --help`)."""
    from rich.table import Table

    gbps = lambda v: f"{v / 1e9:.1f}"
    title = f"expert {shape.label()} ({shape.expert_nbytes / 1e6:.1f} MB); {host['cpu_model']}, "
    title += f"{host['kernel_threads']} threads, {host['isa']}" + ("" if gpu is None else f"; {gpu[0]['name']}")
    table = Table(title=title)
    for column in ("GB/s", "b", "alone", "overlapped", "PCIe overlapped"):
        table.add_column(column, justify="left" if column == "GB/s" else "right")
    if gpu is not None:
        _, pcie, torch_copy, line, _ = gpu
        table.add_row("PCIe expert copy", "", gbps(pcie))
        table.add_row(f"PCIe torch copy (ours/torch {pcie / torch_copy:.2f})", "", gbps(torch_copy))
        table.add_row("PCIe line rate (ceiling)", "", gbps(line))
    for b, v in cpu_alone.items():
        over = () if gpu is None else (gbps(gpu[4][b][1]), gbps(gpu[4][b][0]))
        table.add_row("host kernel", str(b), gbps(v), *over)
    table.add_row("host memory read (ceiling)", "", gbps(host_read))
    console.print(table)
