"""`ft bench bw` and its profile: writing, reading, matching, the `auto` choice, and online refinement of q*.

No GPU needed: the CLI measures the host side; profiles are built by hand; the refinement runs on a CPU-device
expert cache, whose fills are memcpys and whose CPU runs are the real Rust kernels.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time

import numpy as np
import pytest
import torch
from test_cli import assert_user_error, ft

from freetoken import __version__, _core
from freetoken._core import ExpertPool
from freetoken.config import ModelConfig
from freetoken.moe import choose_backend
from freetoken.moe import profile as prof
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.profile import ExpertShape, ProfileError

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
UUID = "GPU-11111111-2222-3333-4444-555555555555"
SHAPE = ExpertShape(2048, 768)


def make_profile(uuid: str = UUID, shape: ExpertShape = SHAPE, pcie: float = 54e9, cpu1: float = 49e9, **top) -> dict:
    """A profile as `ft bench bw` writes it, with B_pcie `pcie` and B_cpu(1) `cpu1` (bytes/s)."""
    curve = {"1": cpu1, "2": cpu1 * 0.8, "4": cpu1 * 0.6, "8": cpu1 * 0.5, "16": cpu1 * 0.45}
    backend, q1 = prof.verdict(pcie, {int(b): v for b, v in curve.items()})
    return {
        "schema_version": prof.SCHEMA_VERSION,
        "freetoken_version": __version__,
        "created_unix_s": time.time(),
        "gpu": {"uuid": uuid, "name": "NVIDIA H200", "index": 0},
        "host": {"cpu_model": "test", "num_cpus": 2, "kernel_threads": 2, "isa": "avx2"},
        "expert": shape.to_dict(),
        "method": {},
        "measured": {},
        "planner": {"pcie_bytes_per_s": pcie, "cpu_bytes_per_s": curve},
        "verdict": {"backend": backend, "q_star_b1": q1, "hybrid_min_q_star": prof.HYBRID_MIN_Q_STAR},
        **top,
    }


def write(directory, profile: dict, uuid: str = UUID, shape: ExpertShape = SHAPE):
    path = prof.profile_path(directory, uuid, shape)
    prof.write_profile(path, profile)
    return path


def test_write_read_roundtrip_atomic(tmp_path):
    path = write(tmp_path, make_profile())
    assert prof.read_profile(path) == json.loads(path.read_text())
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_failed_write_keeps_the_old_profile(tmp_path, monkeypatch):
    path = write(tmp_path, make_profile(pcie=10e9))

    def broken_dump(obj, f, **kwargs):
        f.write('{"schema_version": 1, "half')
        raise OSError("disk full")

    monkeypatch.setattr(prof.json, "dump", broken_dump)
    with pytest.raises(OSError, match="disk full"):
        prof.write_profile(path, make_profile(pcie=99e9))
    assert prof.planner_bandwidths(prof.read_profile(path))[0] == 10e9
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_profile_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_PROFILE_DIR", str(tmp_path / "p"))
    assert prof.profile_dir() == tmp_path / "p"
    monkeypatch.delenv("FREETOKEN_PROFILE_DIR")
    monkeypatch.delenv("FREETOKEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert prof.profile_dir() == tmp_path / "xdg" / "freetoken" / "profiles"


def test_find_matching_profile(tmp_path, caplog):
    write(tmp_path, make_profile())
    write(tmp_path, make_profile("GPU-other"), uuid="GPU-other")  # another GPU's profile beside it: not read
    with caplog.at_level(logging.INFO, logger="freetoken"):
        found = prof.find_profile(UUID, SHAPE, tmp_path)
    assert found is not None and found["gpu"]["uuid"] == UUID
    assert "q*(1)" in caplog.text and "ignored" not in caplog.text


@pytest.mark.parametrize(
    "uuid,shape,needle",
    [("GPU-other", SHAPE, "ignored: it is for GPU 'GPU-other'"), (UUID, ExpertShape(4096, 1536), "I1536")],
)
def test_profile_of_another_gpu_or_shape_is_ignored(tmp_path, caplog, uuid, shape, needle):
    write(tmp_path, make_profile(uuid, shape), uuid=uuid, shape=shape)
    with caplog.at_level(logging.INFO, logger="freetoken"):
        assert prof.find_profile(UUID, SHAPE, tmp_path) is None
    assert needle in caplog.text and "run `ft bench bw`" in caplog.text


def test_profile_whose_content_names_another_gpu_is_ignored(tmp_path, caplog):
    write(tmp_path, make_profile("GPU-copied"))  # a file copied from another box under this GPU's name
    assert prof.find_profile(UUID, SHAPE, tmp_path) is None
    assert "ignored: it is for GPU 'GPU-copied'" in caplog.text


@pytest.mark.parametrize(
    "content,needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps(make_profile(schema_version=99)), "schema_version 99"),
        (json.dumps(make_profile(freetoken_version="0.0.1-old")), "stale: made by freetoken"),
        (json.dumps(make_profile(created_unix_s=time.time() - 31 * 86400)), "stale: 31 days old"),
        (json.dumps(make_profile(planner={"pcie_bytes_per_s": -1, "cpu_bytes_per_s": {"1": 1e9}})), "positive"),
        (json.dumps(make_profile(planner={"pcie_bytes_per_s": 1e9})), "bad planner section"),
        (json.dumps({k: v for k, v in make_profile().items() if k != "gpu"}), "missing section 'gpu'"),
        (json.dumps(make_profile(formats=["nvfp4"])), "formats must be an object"),
        (
            json.dumps(make_profile(formats={"nvfp4": {"planner": {"pcie_bytes_per_s": 0, "cpu_bytes_per_s": {}}}})),
            "formats.nvfp4.planner.pcie_bytes_per_s must be a positive",
        ),
    ],
)
def test_unusable_profile_is_reported_not_used(tmp_path, caplog, content, needle):
    path = prof.profile_path(tmp_path, UUID, SHAPE)
    path.write_text(content)
    with pytest.raises(ProfileError, match=needle.replace("*", r"\*")):
        prof.read_profile(path)
    assert prof.find_profile(UUID, SHAPE, tmp_path) is None
    assert "not used" in caplog.text and needle in caplog.text


def test_unreadable_profile(tmp_path, caplog):
    path = prof.profile_path(tmp_path, UUID, SHAPE)
    path.mkdir(parents=True)  # a directory where the file should be: is_file() is False, so it is scanned
    (tmp_path / "junk.json").write_bytes(b"\xff\xfe")
    assert prof.find_profile(UUID, SHAPE, tmp_path) is None
    assert "junk.json not used: unreadable" in caplog.text


def test_q_star_and_verdict():
    assert prof.q_star(50e9, {1: 50e9, 16: 25e9}, 1) == pytest.approx(0.5)
    # Beyond the last point the CPU is compute-bound: B_cpu(32) = 25e9 * 16 / 32.
    assert prof.q_star(50e9, {1: 50e9, 16: 25e9}, 32) == pytest.approx(12.5 / 62.5)
    assert prof.verdict(54e9, {1: 49e9}) == ("hybrid", pytest.approx(49 / 103))
    assert prof.verdict(54e9, {1: 5e9})[0] == "offload"  # q* 0.085 < 0.15


@pytest.fixture
def cuda_uuid(monkeypatch):
    """Pretend the CUDA device has UUID `UUID` (choose_backend never touches the device otherwise)."""
    monkeypatch.setattr("freetoken.moe.gpu_uuid", lambda device: UUID)


@pytest.mark.cuda_mocked
def test_auto_choice(tmp_path, cuda_uuid, caplog):
    caplog.set_level(logging.INFO, logger="freetoken")
    cuda = torch.device("cuda")
    assert choose_backend("auto", torch.device("cpu"), SHAPE, tmp_path) == ("cpu", None)
    assert choose_backend("auto", cuda, SHAPE, tmp_path) == ("offload", None)  # no profile
    write(tmp_path, make_profile(cpu1=5e9))
    assert choose_backend("auto", cuda, SHAPE, tmp_path)[0] == "offload"  # the profile says offload
    write(tmp_path, make_profile(cpu1=49e9))
    name, profile = choose_backend("auto", cuda, SHAPE, tmp_path)
    assert name == "hybrid" and profile["planner"]["pcie_bytes_per_s"] == 54e9
    assert "--moe-backend auto: hybrid (from the bandwidth profile)" in caplog.text
    # a profile of another shape does not count for this one
    assert choose_backend("auto", cuda, ExpertShape(4096, 1536), tmp_path) == ("offload", None)
    assert choose_backend("offload", cuda, SHAPE, tmp_path)[1] is not None  # offload shows measured vs profiled
    assert choose_backend("fused", cuda, SHAPE, tmp_path) == ("fused", None)


@pytest.mark.cuda_mocked
def test_hybrid_needs_a_profile(tmp_path, cuda_uuid):
    with pytest.raises(ValueError, match="run `ft bench bw"):
        choose_backend("hybrid", torch.device("cuda"), SHAPE, tmp_path)
    with pytest.raises(ValueError, match="needs a GPU"):
        choose_backend("hybrid", torch.device("cpu"), SHAPE, tmp_path)
    write(tmp_path, make_profile(cpu1=5e9))  # explicit hybrid runs even where auto would pick offload
    assert choose_backend("hybrid", torch.device("cuda"), SHAPE, tmp_path)[0] == "hybrid"


def test_expert_cache_refines_the_planner_online():
    """CPU device, hybrid: the Rust layer server times fills (memcpy) and CPU runs (the Rust kernels) and hands them
    to the planner, whose q* follows the bounded EMA (the rule itself: `planner::tests` in the Rust core); stats()
    shows profiled against measured."""
    pool = ExpertPool.random(2, 16, 64, 32, seed=3)
    profile_cpu = {1: 20e9, 4: 40e9, 16: 60e9}
    backend = ExpertCacheBackend("hybrid", pool, torch.device("cpu"), 4, pcie_bytes_per_s=50e9,
                                 cpu_bytes_per_s=profile_cpu, cpu_threads=2)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for step in range(32):
        ids = torch.randint(0, 16, (3, 4), generator=gen)
        hidden = torch.randn(3, 64, generator=gen)
        backend.forward(step % 2, hidden, ids, torch.full((3, 4), 0.25))
    stats = backend.stats()["bandwidth"]
    for path in ("pcie", "cpu"):
        assert stats[path]["num_samples"] > 0 and stats[path]["measured_gbps"] > 0
        assert stats[path]["measured_over_profiled"] > 0
    assert stats["pcie"]["profiled_gbps"] == {1: 50.0} and stats["cpu"]["profiled_gbps"] == {1: 20.0, 4: 40.0, 16: 60.0}
    json.dumps(backend.stats())  # GET /v1/stats serves it
    # The planner's q* is the one of the refined (bounded) bandwidths, which moved off the profile.
    pcie, cpu = backend.planner.refined_profile()
    assert backend.planner.q_star(1) == pytest.approx(prof.q_star(pcie, cpu, 1), rel=1e-6)
    assert (pcie, cpu) != backend.planner.profile()
    assert 0.25 - 1e-9 <= pcie / 50e9 <= 4 + 1e-9
    assert stats["pcie"]["refined_gbps"] == {1: round(pcie / 1e9, 3)}


def test_offload_without_profile_still_measures():
    pool = ExpertPool.random(1, 8, 64, 32, seed=1)
    backend = ExpertCacheBackend("offload", pool, torch.device("cpu"), 2, cpu_threads=1)
    backend.forward(0, torch.randn(2, 64), torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 0.5))
    stats = backend.stats()["bandwidth"]
    assert stats["pcie"]["measured_gbps"] > 0 and stats["pcie"]["profiled_gbps"] is None
    assert stats["cpu"]["measured_gbps"] > 0  # 4 experts, 2 slots: the rest ran on the host


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_gpu_measures_the_host_side(tmp_path):
    result = ft("bench", "bw", "--preset", "qwen3-30b-a3b", "--seconds", "0.05", "--pool-gb", "0.1",
                "--cpu-threads", "2", "--format", "bf16", "nvfp4", "--out", str(tmp_path / "profiles"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU present" in result.stdout and "no profile written" in result.stdout
    for row in ("host kernel", "host memory read", "nvfp4 (2.65 MB) host kernel"):
        assert row in result.stdout
    assert not (tmp_path / "profiles").exists()


def test_cli_help_and_errors(tmp_path):
    out = ft("bench", "bw", "--help").stdout
    needles = ("--model", "--preset", "--seconds", "--device", "--out", "FREETOKEN_PROFILE_DIR", "q*", "overlapped")
    for needle in needles:
        assert needle in out
    assert_user_error(ft("bench", "bw", "--model", str(tmp_path / "nope")), "config.json")
    assert_user_error(ft("bench", "bw", "--seconds", "0"), "--seconds")
    assert_user_error(ft("bench", "bw", "--device", "tpu"), "--device 'tpu' is not a device")
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    assert_user_error(ft("bench", "bw", "--device", missing), f"--device {missing}: torch sees")


def test_device_picks_the_gpus_measured(monkeypatch):
    """`ft bench bw --device` as `ft serve --device` takes it (`parse_device`): cpu measures the host side only,
    cuda:N that GPU alone, cuda the current one, none every visible GPU; a device this machine lacks is refused
    before anything is measured. Two GPUs are faked: only the argument handling runs."""
    from freetoken.cli.bench import _gpu_indices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _gpu_indices(None) == [0, 1]
    assert _gpu_indices("cpu") == []
    assert _gpu_indices("cuda:1") == [1]
    assert _gpu_indices("cuda") == [0]
    for bad, needle in [
        ("cuda:2", "--device cuda:2: torch sees 2 CUDA device(s) here, cuda:0 to cuda:1"),
        ("cuda:x", "--device 'cuda:x' is not a device (cpu, cuda or cuda:N)"),
        ("mps", "--device 'mps': freetoken runs on cpu or cuda"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(needle)}$"):
            _gpu_indices(bad)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _gpu_indices(None) == []
    with pytest.raises(ValueError, match="--device cuda:0: torch sees no CUDA device here; use --device cpu"):
        _gpu_indices("cuda:0")


def test_cli_device_cpu_measures_the_host_side_only(tmp_path):
    """--device cpu on any box (a GPU one too): the host side only, and no profile written."""
    result = ft("bench", "bw", "--device", "cpu", "--preset", "qwen3-30b-a3b", "--seconds", "0.05", "--pool-gb",
                "0.1", "--cpu-threads", "2", "--format", "bf16", "--out", str(tmp_path / "profiles"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--device cpu: measured the host side only; no profile written" in result.stdout
    assert "host kernel" in result.stdout and "PCIe expert copy" not in result.stdout
    assert not (tmp_path / "profiles").exists()


def test_formats_that_do_not_split_the_model_are_skipped_or_refused_before_measuring(tmp_path):
    """The demo's experts (I 32) split into no 128 x 128 FP8 block: by default `ft bench bw` measures the other
    formats (fp8_block skipped with a note); asked for by --format, fp8_block is refused naming the flag, before
    any measurement. An FP8 checkpoint's own `weight_block_size` is the block measured."""
    from freetoken.bench.box import format_for
    from freetoken.cli.bench import _formats, _model_config
    from freetoken.cli.main import build_parser

    cfg = _model_config(build_parser().parse_args(["bench", "bw", "--model", "demo"]))
    shape = ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size)
    assert cfg.moe_intermediate_size % 128
    assert _formats(cfg, shape, None) == ["bf16", "nvfp4", "mxfp4"]
    start = time.perf_counter()
    assert_user_error(ft("bench", "bw", "--model", "demo", "--format", "fp8_block"), "--format fp8_block", "128")
    assert time.perf_counter() - start < 60  # refused up front, not after the bf16 measurements
    raw = {**cfg.raw, "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    fp8 = format_for(ModelConfig.from_dir(tmp_path), shape, "fp8_block")
    assert (fp8.block_rows, fp8.block_cols) == (32, 32)


def test_model_demo_as_serve_takes_it():
    from freetoken.cli.bench import _model_config
    from freetoken.cli.main import build_parser

    args = build_parser().parse_args(["bench", "bw", "--model", "demo"])
    cfg = _model_config(args)
    assert cfg.num_experts > 0 and cfg.moe_intermediate_size > 0


def test_profile_figures_are_keyed_by_format_with_a_bf16_fallback(tmp_path, caplog):
    """A format measured has its own planner figures; one not measured (or an old profile without "formats") gets
    bf16's bytes/s, logged; bf16 reads the top-level figures either way."""
    nv = {"pcie_bytes_per_s": 50e9, "cpu_bytes_per_s": {"1": 40e9, "16": 20e9}}
    write(tmp_path, make_profile(formats={"nvfp4": {"expert_nbytes": 2_359_308, "planner": nv}}))
    found = prof.find_profile(UUID, SHAPE, tmp_path)
    assert found is not None
    bf16 = prof.planner_bandwidths(found)
    assert bf16 == (54e9, {1: 49e9, 2: 49e9 * 0.8, 4: 49e9 * 0.6, 8: 49e9 * 0.5, 16: 49e9 * 0.45})
    assert prof.planner_bandwidths(found, "bf16") == bf16
    with caplog.at_level(logging.INFO, logger="freetoken"):
        assert prof.planner_bandwidths(found, "nvfp4") == (50e9, {1: 40e9, 16: 20e9})
        assert "no nvfp4 figures" not in caplog.text
        assert prof.planner_bandwidths(found, "fp8_block") == bf16
    assert "no fp8_block figures (measured: bf16, nvfp4)" in caplog.text and "--format fp8_block" in caplog.text
    old = make_profile()  # written before profiles were keyed by format
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="freetoken"):
        assert prof.planner_bandwidths(old, "mxfp4") == bf16
    assert "no mxfp4 figures (measured: bf16)" in caplog.text


def test_measure_box_measures_each_format_and_the_profile_keys_them(tmp_path):
    """The host side of `measure_box` for two quantized formats: each format's own kernel (its `CpuExperts`) at
    every b on a pool of its real expert size; a GPU's figures of a format go to the profile under its name and read
    back through `planner_bandwidths`, bf16's staying at the top level."""
    from freetoken.bench.box import FormatRun, GpuRun, PathRates, build_profile, measure_box
    from freetoken.config import ModelConfig
    from freetoken.models.presets import preset_config_path
    from freetoken.moe.profile import BATCHES

    cfg = ModelConfig.from_dict(json.loads(preset_config_path("qwen3-30b-a3b").read_text()), source="test")
    shape = ExpertShape(256, 128)
    run = measure_box(shape, cfg, 2, [], seconds=0.01, pool_gb=0.002, cpu_threads=1, formats=["nvfp4", "fp8_block"])
    assert set(run.formats) == {"nvfp4", "fp8_block"} and run.gpus == []
    nv, fp8 = run.formats["nvfp4"], run.formats["fp8_block"]
    assert nv.expert_nbytes == _core.expert_layout("nvfp4", 256, 128)["expert_nbytes"]
    assert fp8.block == (128, 128)
    assert fp8.expert_nbytes == _core.expert_layout("fp8_block", 256, 128, (128, 128))["expert_nbytes"]
    for f in (nv, fp8):
        assert set(f.cpu_alone) == set(BATCHES) and all(v > 0 for v in f.cpu_alone.values()) and f.gpus == {}
    # What one GPU's measurement adds: bf16's figures, and nvfp4's own.
    bf16_over = {b: (40e9, 0.5 * run.cpu_alone[b]) for b in BATCHES}
    gpu = GpuRun(
        50e9, bf16_over, 40e9, {b: c for b, (_, c) in bf16_over.items()}, {"uuid": UUID, "index": 0}, 45e9, 55e9
    )
    nv_over = {b: (30e9, 0.7 * nv.cpu_alone[b]) for b in BATCHES}
    nv_paths = PathRates(35e9, nv_over, 30e9, {b: c for b, (_, c) in nv_over.items()})
    nv = FormatRun("nvfp4", None, nv.expert_nbytes, nv.cpu_alone, {0: nv_paths})
    run = dataclasses.replace(run, gpus=[gpu], formats={"nvfp4": nv})
    profile = build_profile(run, gpu, shape)
    entry = profile["formats"]["nvfp4"]
    assert entry["measured"]["pcie_expert_bytes_per_s"] == 35e9 and entry["expert_nbytes"] == nv.expert_nbytes
    assert prof.planner_bandwidths(profile, "nvfp4") == (30e9, nv_paths.planner_cpu)
    assert prof.planner_bandwidths(profile) == (40e9, gpu.planner_cpu)
    path = write(tmp_path, profile, shape=shape)
    assert prof.planner_bandwidths(prof.read_profile(path), "nvfp4") == (30e9, nv_paths.planner_cpu)


def test_measure_cpu_counts_expert_bytes():
    from freetoken._core import CpuExperts
    from freetoken.bench.bandwidth import measure_cpu, measure_host_read

    pool = ExpertPool.random(2, 8, 128, 64, seed=2)
    cpu = CpuExperts(pool, num_threads=1)
    assert measure_cpu(cpu, pool, 2, experts_per_call=4, seconds=0.01) > 0
    assert measure_host_read(pool, 1) > 0
    assert np.isfinite(measure_cpu(cpu, pool, 1, experts_per_call=99, seconds=0.01))  # capped at E per call


@pytest.mark.gpu
@needs_gpu
def test_gpu_bench_writes_the_profile_auto_reads(tmp_path):
    """A short `ft bench bw` on the real GPU: one profile per GPU, keyed by the UUID `choose_backend` looks up."""
    from freetoken.moe import gpu_uuid

    result = ft("bench", "bw", "--seconds", "0.1", "--pool-gb", "1", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "verdict" in result.stdout and "profile written" in result.stdout
    assert len(list(tmp_path.glob("*.json"))) == torch.cuda.device_count()
    cuda = torch.device("cuda", 0)
    name, found = choose_backend("auto", cuda, SHAPE, tmp_path)
    assert found is not None and found["gpu"]["uuid"] == gpu_uuid(cuda)
    assert name == prof.verdict(*prof.planner_bandwidths(found))[0]
    measured = found["measured"]
    assert measured["pcie_expert_bytes_per_s"] <= 1.2 * measured["pcie_line_rate_bytes_per_s"]


@pytest.mark.gpu
@needs_gpu
def test_gpu_fill_events_are_read_without_a_sync():
    """On CUDA, eager steps fill through the Rust layer server: its copier times one group of fills in four with
    events on the copy stream, and the planner gets the samples (the same path as the driven decode)."""
    pool = ExpertPool.random(2, 16, 256, 128, seed=4)
    cuda = torch.device("cuda")
    backend = ExpertCacheBackend("hybrid", pool, cuda, 4, pcie_bytes_per_s=50e9,
                                 cpu_bytes_per_s={1: 20e9, 16: 40e9}, cpu_threads=2)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for step in range(32):
        ids = torch.randint(0, 16, (2, 4), generator=gen).to(cuda)
        hidden = torch.randn(2, 256, generator=gen).to(cuda, torch.bfloat16)
        backend.forward(step % 2, hidden, ids, torch.full((2, 4), 0.25, device=cuda, dtype=torch.bfloat16))
    stats = backend.stats()["bandwidth"]
    assert stats["pcie"]["num_samples"] > 0 and stats["pcie"]["measured_gbps"] > 0
    assert stats["cpu"]["num_samples"] > 0


def test_nvidia_driver_version_parsing():
    from freetoken.bench.box import nvidia_driver_version

    assert (
        nvidia_driver_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.03  Thu Jan 1\n") == "580.159.03"
    )
    text = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.03  Release Build  (dvs-builder@U16)\n"
    assert nvidia_driver_version(text) == "580.159.03"
    assert nvidia_driver_version("") is None


@pytest.mark.cuda_mocked
def test_a_missing_profile_is_measured_once(tmp_path, cuda_uuid):
    """`ft serve` on a GPU without a profile measures one (`measure`) and runs what it says; a profile that exists
    is read, not measured again; `--no-auto-profile` (no `measure`) keeps offload."""
    cuda = torch.device("cuda")
    calls = []

    def measure():
        calls.append(1)
        profile = make_profile(cpu1=49e9)
        write(tmp_path, profile)
        return profile

    name, profile = choose_backend("auto", cuda, SHAPE, tmp_path, measure=measure)
    assert (name, len(calls)) == ("hybrid", 1) and profile["planner"]["pcie_bytes_per_s"] == 54e9
    assert choose_backend("auto", cuda, SHAPE, tmp_path, measure=measure)[0] == "hybrid" and len(calls) == 1
    assert choose_backend("hybrid", cuda, ExpertShape(4096, 1536), tmp_path, measure=lambda: make_profile())[0] == (
        "hybrid"
    )
    assert choose_backend("offload", cuda, ExpertShape(4096, 1536), tmp_path, measure=measure) == ("offload", None)
    assert choose_backend("auto", cuda, ExpertShape(4096, 1536), tmp_path) == ("offload", None)


def test_unwritable_profile_dir_keeps_the_measured_profile(tmp_path, monkeypatch, caplog):
    """`ft serve`'s first-start measurement whose profile cannot be written (its directory is a file here) logs a
    warning and returns the measured figures, which the backend choice then uses: the server goes on."""
    from freetoken.bench import box
    from freetoken.config import ModelConfig
    from freetoken.models.presets import preset_config_path

    cfg = ModelConfig.from_dict(json.loads(preset_config_path("qwen3-30b-a3b").read_text()), source="qwen3-30b-a3b")
    shape = ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size)
    curve = {1: 49e9, 2: 40e9, 4: 30e9}
    gpu = box.GpuRun(
        pcie=50e9,
        overlapped={1: (50e9, 45e9)},
        planner_pcie=54e9,
        planner_cpu=curve,
        info={"uuid": UUID, "name": "NVIDIA H200"},
        torch_copy=54e9,
        line_rate=63e9,
    )
    run = box.BoxRun({"cpu_model": "test"}, {"seconds": 0.5}, 200e9, curve, [gpu])
    # The measurement itself needs a GPU (test_measure_profile_on_the_gpu): this test is about its write.
    monkeypatch.setattr(box, "measure_box", lambda *args, **kwargs: run)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=box.__name__):
        profile = box.measure_profile(shape, cfg, 0, blocker / "profiles")
    assert profile["planner"]["pcie_bytes_per_s"] == 54e9 and profile["gpu"]["uuid"] == UUID
    assert "could not write the bandwidth profile" in caplog.text and "next start measures again" in caplog.text
    assert blocker.read_text() == ""


@pytest.mark.gpu
@needs_gpu
def test_measure_profile_on_the_gpu(tmp_path):
    """The real measurement `ft serve` runs on first start writes a profile that `find_profile` then reads."""
    from freetoken.bench.box import measure_profile
    from freetoken.config import ModelConfig
    from freetoken.models.presets import preset_config_path

    cfg = ModelConfig.from_dict(json.loads(preset_config_path("qwen3-30b-a3b").read_text()), source="qwen3-30b-a3b")
    shape = ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size)
    profile = measure_profile(shape, cfg, 0, tmp_path)
    assert profile["planner"]["pcie_bytes_per_s"] > 1e9
    found = prof.find_profile(str(torch.cuda.get_device_properties(0).uuid), shape, tmp_path)
    assert found is not None and found["planner"] == profile["planner"]
