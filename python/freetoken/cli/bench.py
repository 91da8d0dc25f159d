"""`ft bench bw`: measure this box's two expert-miss paths and write the bandwidth profile q* reads."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken.cli.serve import DEMO
from freetoken.config import ModelConfig, parse_device

if TYPE_CHECKING:
    from freetoken.moe.profile import ExpertShape

log = logging.getLogger("freetoken.cli")

DEFAULT_PRESET = "qwen3-30b-a3b"
EXPERT_FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")

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
  --format FMT ...     each quantized format (fp8_block: the model's blocks, else 128x128; nvfp4, mxfp4) on a
                       random pool of its own (default: each that splits the model's expert sizes): its
                       host kernel, expert copies and both overlapped, as above (GB/s of its expert bytes, scales
                       included), stored by format in the profile; a profile without a format gives the planner
                       bf16's GB/s for it (an expert's time then scales with its bytes)
Verdict: hybrid when q*(b=1) = B_cpu(1) / (B_cpu(1) + B_pcie) >= 0.15 (below, the saved miss time does not pay
for CPU runs buying no future hits), else offload.

Shapes: --model DIR (its config.json), --preset NAME, or {DEFAULT_PRESET}. Profiles go to --out, else
$FREETOKEN_PROFILE_DIR, else $XDG_CACHE_HOME/freetoken/profiles. Without a GPU only the host side is measured
and no profile is written. Every visible GPU gets its own profile (restrict with --device cuda:N or
CUDA_VISIBLE_DEVICES); --device cpu measures the host side only.
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
    source.add_argument("--preset", choices=preset_names(), help=f"a shipped real config (default: {DEFAULT_PRESET})")
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
    bw.add_argument(
        "--format",
        nargs="+",
        choices=EXPERT_FORMATS,
        default=None,
        help="expert formats to measure (default: every one the model's expert sizes split into; bf16 is always "
        "measured)",
    )
    bw.add_argument(
        "--device",
        default=None,
        help="device to measure: cpu (the host side only, no profile), cuda or cuda:N (that GPU alone) (default: "
        "every visible GPU)",
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


def _formats(cfg: ModelConfig, shape: ExpertShape, asked: list[str] | None) -> list[str]:
    """The formats to measure: `asked` (--format), each of which must split the model's expert sizes (else a
    ValueError naming --format, before anything is measured), or by default every format that does (the others
    are skipped with a note)."""
    from freetoken.bench.box import format_for
    from freetoken.quant.formats import QuantConfigError

    formats = []
    for name in asked or EXPERT_FORMATS:
        try:
            format_for(cfg, shape, name)
        except QuantConfigError as e:
            if asked:
                raise ValueError(f"--format {name}: {e}; leave it out") from e
            log.info("not measuring %s: %s", name, e)
            continue
        formats.append(name)
    return formats


def _gpu_indices(device: str | None) -> list[int]:
    """The CUDA devices to measure: --device's (none for cpu; `parse_device` refuses one this machine does not
    have, before anything is measured), else every visible one."""
    import torch

    if device is None:
        return list(range(torch.cuda.device_count() if torch.cuda.is_available() else 0))
    chosen = parse_device(device)
    if chosen.type == "cpu":
        return []
    return [torch.cuda.current_device() if chosen.index is None else chosen.index]


def run_bw(args: argparse.Namespace) -> int:
    """Measure, print the table and verdict, write one profile per GPU measured (none without a GPU)."""
    if args.seconds <= 0 or args.pool_gb <= 0 or args.cpu_threads < 0 or args.experts_per_call < 0:
        raise ValueError("--seconds and --pool-gb must be > 0, --cpu-threads and --experts-per-call >= 0")
    cfg = _model_config(args)
    from rich.console import Console

    from freetoken.bench.box import build_profile, measure_box
    from freetoken.moe.profile import (
        HYBRID_MIN_Q_STAR,
        ExpertShape,
        profile_dir,
        profile_path,
        verdict,
        write_profile,
    )  # fmt: skip

    shape = ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size)
    formats = _formats(cfg, shape, args.format)
    gpu_indices = _gpu_indices(args.device)
    run = measure_box(
        shape, cfg, args.experts_per_call or cfg.num_experts_per_tok, gpu_indices, seconds=args.seconds,
        pool_gb=args.pool_gb, cpu_threads=args.cpu_threads, formats=formats,
    )  # fmt: skip
    console = Console(no_color="NO_COLOR" in os.environ)
    if not run.gpus:
        _table(console, shape, run, None)
        why = "no CUDA GPU present" if args.device is None else f"--device {args.device}"
        console.print(f"{why}: measured the host side only; no profile written")
        return 0
    directory = args.out if args.out is not None else profile_dir()
    for gpu in run.gpus:
        profile = build_profile(run, gpu, shape)
        backend, q1 = verdict(gpu.planner_pcie, gpu.planner_cpu)
        _table(console, shape, run, gpu)
        path = profile_path(directory, gpu.info["uuid"], shape)
        write_profile(path, profile)
        console.print(
            f"cuda:{gpu.info['index']} verdict: [bold]{backend}[/bold], q*(b=1) = {q1:.2f} "
            f"({'>=' if backend == 'hybrid' else '<'} {HYBRID_MIN_Q_STAR}); profile written to {path}"
        )
    return 0


def _table(console, shape, run, gpu) -> None:
    """The run as a rich table, GB/s alone and overlapped (the methods are in `ft bench bw --help`)."""
    from rich.table import Table

    gbps = lambda v: f"{v / 1e9:.1f}"
    host = run.host
    title = f"expert {shape.label()} ({shape.expert_nbytes / 1e6:.3g} MB); {host['cpu_model']}, "
    title += f"{host['kernel_threads']} threads, {host['isa']}" + ("" if gpu is None else f"; {gpu.info['name']}")
    table = Table(title=title)
    for column in ("GB/s", "b", "alone", "overlapped", "PCIe overlapped"):
        table.add_column(column, justify="left" if column == "GB/s" else "right")
    if gpu is not None:
        table.add_row("PCIe expert copy", "", gbps(gpu.pcie))
        table.add_row(f"PCIe torch copy (ours/torch {gpu.pcie / gpu.torch_copy:.2f})", "", gbps(gpu.torch_copy))
        table.add_row("PCIe line rate (ceiling)", "", gbps(gpu.line_rate))
    for b, v in run.cpu_alone.items():
        over = () if gpu is None else (gbps(gpu.overlapped[b][1]), gbps(gpu.overlapped[b][0]))
        table.add_row("host kernel", str(b), gbps(v), *over)
    table.add_row("host memory read (ceiling)", "", gbps(run.host_read))
    for name, f in run.formats.items():
        label = f"{name} ({f.expert_nbytes / 1e6:.3g} MB)"
        paths = None if gpu is None else f.gpus[gpu.info["index"]]
        if paths is not None:
            table.add_row(f"{label} PCIe expert copy", "", gbps(paths.pcie))
        for b, v in f.cpu_alone.items():
            over = () if paths is None else (gbps(paths.overlapped[b][1]), gbps(paths.overlapped[b][0]))
            table.add_row(f"{label} host kernel", str(b), gbps(v), *over)
    console.print(table)
