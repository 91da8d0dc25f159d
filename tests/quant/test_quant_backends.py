"""Quantized experts (FP8 block, NVFP4, MXFP4) through every backend: the host pool holds each expert in its checkpoint
format, the slots the same bytes, the Rust `LayerServer` copies them and runs the host experts with the quantized
kernels, the slot kernel dequantizes in its loop; each backend gives the logits of the float model built from the
dequantized weights.

Tolerances, relative to the largest logit: on the CPU device (float32) the dequantized weights are the float
model's bit for bit (`test_quant.py`), so the slot path agrees to float32 rounding and the host kernels to 1e-4 on
the float32-activation paths (float32 sums in another order) or 2e-3 on the bf16 ones (`avx512_bf16`, `amx_bf16`
round the experts' inputs to bf16, as for bf16 pools: `tests/moe/test_moe_backends.py`). On CUDA (bfloat16,
gpu-marked) the float model's weights are the dequantized ones rounded to bf16 while the kernels use them
unrounded: 3e-2, as the bf16 backend test allows for the host path.
"""

from __future__ import annotations

import pytest
import torch

import freetoken.engine  # noqa: F401  (before freetoken.models.loader, which imports only after the engine)
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.models.loader import CheckpointError, check_finite_weights, load_checkpoint
from freetoken.moe import build_expert_pool, make_expert_backend
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.fused import FusedExperts
from freetoken.quant import MXFP4, NVFP4, fp8_block
from freetoken.quant.checkpoint import build_quantized_checkpoint, quantization_config
from greedy import greedy_tokens

SMALL = {"vocab_size": 2048, "num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts": 16}
SMALL["num_experts_per_tok"] = 4
FP8_SMALL = fp8_block(32, 32)  # the demo's sizes (H 64, I 32) in whole blocks
PROFILE = dict(pcie_bytes_per_s=50e9, cpu_bytes_per_s={1: 20e9, 4: 40e9, 16: 60e9})
PROMPTS = [[3, 17, 100, 42, 7, 8, 9, 200, 13], list(range(1000, 1040))]


def _cpu_tol(stats: dict) -> float:
    """Tolerance of host-kernel runs on the CPU device: the bf16 paths round the experts' inputs to bf16."""
    return 2e-3 if stats["cpu_isa"] in ("avx512_bf16", "amx_bf16") else 1e-4


@pytest.fixture(scope="module")
def checkpoint_overrides():
    """The seed and config of this module's `built` checkpoints (tests/conftest.py)."""
    return 7, SMALL


def _on(device: str, built) -> None:
    """GPU cases run a few plans of one checkpoint per format: each new kernel configuration costs a Triton
    compile on the device, and FP8's fused 3-D layout packs its per-expert layout's bytes (its reading is tested on
    the CPU). MXFP4 checkpoints are fused only."""
    if device == "cuda" and built[2].name == "fp8_block" and "fused" in str(built[0]):
        pytest.skip("the fused 3-D FP8 layout packs the per-expert layout's bytes: CPU-tested")


def _gpu(*values):
    return pytest.param("cuda", *values, marks=pytest.mark.gpu)


@pytest.mark.parametrize(
    "device,mode,num_slots",
    [
        *(("cpu", m, n) for m, n in [("offload", 64), ("offload", 5), ("offload", 1), ("cpu", 0), ("hybrid", 64)]),
        ("cpu", "hybrid", 3),
        _gpu("offload", 5),
        _gpu("hybrid", 3),
    ],
)
def test_backend_logits_equal_the_dequantized_model(built, mode, num_slots, device):
    from test_moe_backends import _logits  # after freetoken.engine (the loader imports it first)

    _on(device, built)
    q, deq, fmt = built
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    want = [_logits(load_checkpoint(deq, FusedExperts(), device, dtype), p) for p in PROMPTS]
    pool = build_expert_pool(ModelConfig.from_dir(q), q)
    assert pool.format == fmt.name and pool.expert_nbytes == fmt.layout(64, 32).expert_nbytes
    backend = ExpertCacheBackend(mode, pool, device, num_slots, cpu_threads=2, **PROFILE)
    model = load_checkpoint(q, backend, device, dtype)
    got = [[_logits(model, p) for p in PROMPTS] for _ in range(2)]  # the second pass starts from a warm cache
    stats = backend.stats()
    layers = stats["layers"]
    hits, fills, cpu = sum(layers["hits"]), sum(layers["fills"]), sum(layers["cpu_runs"])
    tol = (_cpu_tol(stats) if cpu else 1e-5) if device.type == "cpu" else 3e-2
    for run in got:
        for logits, expected in zip(run, want, strict=True):
            assert (logits - expected).abs().max().item() <= tol * expected.abs().max().item()
    # The planner counts the format's bytes: what the fills moved and what the host kernels read.
    assert stats["expert_format"] == fmt.name
    assert sum(layers["bytes_h2d"]) == fills * pool.expert_nbytes
    assert sum(layers["bytes_cpu"]) == cpu * pool.expert_nbytes
    if mode == "cpu":
        assert fills == 0 and hits == 0 and cpu > 0
    if mode == "offload" and num_slots == 1:
        assert cpu > 0
    if mode == "hybrid" and num_slots == 3:
        assert fills > 0 and cpu > 0


@pytest.mark.parametrize("moe_backend,slots", [("cpu", 0), ("offload", 3), ("offload", 0)])
def test_engine_generates_the_dequantized_models_tokens(built, moe_backend, slots):
    """Through the engine and its scheduler (prefill chunks and decode steps; on the CPU device the layer server
    fills the host slots with its memcpy copier): the greedy tokens of the float model."""
    q, deq, _ = built
    cfg = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=2, max_prefill_tokens=16)
    want = greedy_tokens(LLMEngine.from_dir(deq, EngineConfig(moe_backend="fused", **cfg)), PROMPTS, 6)
    engine = LLMEngine.from_dir(q, EngineConfig(moe_backend=moe_backend, expert_slots=slots, **cfg))
    assert greedy_tokens(engine, PROMPTS, 6) == want
    assert engine.experts.pool.format == built[2].name


@pytest.mark.parametrize("fmt", [FP8_SMALL, NVFP4, MXFP4], ids=lambda f: f.name)
def test_dummy_weights_build_a_quantized_pool(fmt):
    """A dummy-weights model whose config carries a quantization_config gets a pool in that format (the device
    benchmark's path at real shapes): random codes, finite, at the format's byte size."""
    from freetoken.models.demo import demo_config

    raw = {**demo_config(**SMALL), "quantization_config": quantization_config(fmt, [])}
    model_cfg = ModelConfig.from_dict(raw)
    backend = make_expert_backend(EngineConfig(device="cpu", moe_backend="offload"), model_cfg, None, torch.float32)
    assert backend.pool.format == fmt.name
    assert backend.expert_nbytes == fmt.layout(64, 32).expert_nbytes < 3 * 64 * 32 * 2
    check_finite_weights(torch.nn.Linear(1, 1), backend)
    torch.manual_seed(0)
    hidden = torch.randn(3, 64)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [0, 2, 4, 6]])
    out = backend.forward(model_cfg.moe_layers[0], hidden, ids, torch.full((3, 4), 0.25))
    assert out.shape == (3, 64) and torch.isfinite(out).all() and out.abs().max() > 0


def test_nonfinite_quantized_experts_are_refused(built, tmp_path):
    q, _, fmt = built
    backend = ExpertCacheBackend("cpu", build_expert_pool(ModelConfig.from_dir(q), q), torch.device("cpu"), 0)
    check_finite_weights(torch.nn.Linear(1, 1), backend)
    offset, _ = fmt.layout(64, 32).sections["down_scale"]
    backend.pool_experts[16 + 5, offset + 3] = 0xFF  # e4m3's NaN scale (NVFP4), e8m0's (MXFP4); FP8: below
    if fmt.scale_bytes == 4:
        backend.pool_experts[16 + 5, offset : offset + 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    layer = ModelConfig.from_dir(q).moe_layers[1]
    with pytest.raises(CheckpointError, match=f"routed expert 5 of model layer {layer} holds NaN"):
        check_finite_weights(torch.nn.Linear(1, 1), backend)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.2.mlp.experts.9.gate_proj.weight_scale_2"),
            r"experts\.9\.gate_proj\.weight_scale_2' missing",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.3.down_proj.weight_scale": torch.ones(64, 4).to(torch.float8_e4m3fn)}
            ),
            r"experts\.3\.down_proj\.weight_scale' has shape \[64, 4\], expected \[64, 2\]",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.experts.3.up_proj.weight_scale": torch.ones(32, 4)}),
            r"experts\.3\.up_proj\.weight_scale' has dtype F32; expected one of F8_E4M3",
        ),
        (  # an expert left unquantized: its dtype is the cause named, not the shape that follows from it
            lambda t: t.update({"model.layers.0.mlp.experts.3.gate_proj.weight": torch.zeros(32, 64).bfloat16()}),
            r"experts\.3\.gate_proj\.weight' has dtype BF16; expected one of U8",
        ),
        (
            lambda t: t.update({"model.layers.2.mlp.experts.gate_up_proj": torch.zeros(16, 64, 32, dtype=torch.uint8)}),
            r"experts\.gate_up_proj: fused 3-D nvfp4 experts are no released layout",
        ),
    ],
)
def test_quantized_pool_refuses_broken_scales_naming_the_tensor(tmp_path, edit, message):
    """The pool's reader names the tensor and what it expects, as the fused loader does (`test_quant.py`)."""
    from safetensors.torch import load_file, save_file

    q = build_quantized_checkpoint(tmp_path / "q", NVFP4, seed=1, **SMALL)
    tensors = load_file(q / "model.safetensors")
    edit(tensors)
    save_file(tensors, q / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        build_expert_pool(ModelConfig.from_dir(q), q)


def test_quantized_config_of_a_dummy_model_is_checked():
    from freetoken.models.demo import demo_config
    from freetoken.quant import QuantConfigError

    raw = {**demo_config(**SMALL), "quantization_config": {"quant_method": "fp8", "weight_block_size": [48, 48]}}
    with pytest.raises(QuantConfigError, match="not a multiple of the fp8_block block"):
        build_expert_pool(ModelConfig.from_dict(raw), None)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [12])
def test_cuda_graph_decode_with_quantized_slots_equals_fused(built, slots):
    """Decode steps captured in CUDA graphs, served by the Rust driver thread (fills by the driver API into slots
    of the format's bytes, the staged slot kernel `fused_moe_quant_tiles`): the greedy tokens of `fused` over the
    same quantized experts, which runs the same kernel over expert ids. 12 slots: fills and evictions every step,
    no host experts (which would round differently)."""
    _on("cuda", built)
    q, _, _ = built
    cfg = dict(device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=2, kv_cache_gb=0.05)
    want = greedy_tokens(LLMEngine.from_dir(q, EngineConfig(moe_backend="fused", **cfg)), PROMPTS, 12)
    engine = LLMEngine.from_dir(q, EngineConfig(moe_backend="offload", expert_slots=slots, **cfg))
    assert greedy_tokens(engine, PROMPTS, 12) == want
    stats = engine.experts.stats()
    assert stats["expert_format"] == built[2].name and sum(stats["layers"]["cpu_runs"]) == 0
    if slots == 12:
        assert sum(stats["layers"]["fills"]) > 0 and stats["decode_driver"]["steps"] > 0


def test_the_expert_reader_packs_bf16_as_the_rust_pool_does(bf16_checkpoint):
    """`read_experts` is the one Python reader of checkpoint experts (the `fused` backend's and the pool's, every
    format): on a bf16 checkpoint it gives the Rust pool reader's bytes, expert for expert."""
    from freetoken._core import ExpertPool
    from freetoken.models.loader import CheckpointReader, TensorIndex
    from freetoken.quant import BF16
    from freetoken.quant.checkpoint import fill_pool, read_experts
    from freetoken.quant.formats import QuantSpec

    cfg = ModelConfig.from_dir(bf16_checkpoint)
    rust = ExpertPool.from_checkpoint(bf16_checkpoint)
    layout = BF16.layout(cfg.hidden_size, cfg.moe_intermediate_size)
    reader = CheckpointReader(TensorIndex.scan(bf16_checkpoint))
    layer = cfg.moe_layers[-1]
    packed = read_experts(reader, QuantSpec(BF16), layout, cfg.num_experts, layer, "model.")
    reader.close()
    for e in range(cfg.num_experts):
        assert torch.equal(packed[e], torch.frombuffer(rust.expert_view(len(cfg.moe_layers) - 1, e), dtype=torch.uint8))
    python = ExpertPool.zeroed(len(cfg.moe_layers), cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    fill_pool(python, bf16_checkpoint, cfg, QuantSpec(BF16))
    assert bytes(python.arena_view()) == bytes(rust.arena_view())


@pytest.mark.parametrize(
    "device,mode,strategy,buffers,num_slots",
    [
        ("cpu", "offload", "stream", 2, 9),
        ("cpu", "offload", "stream", 1, 1),
        ("cpu", "hybrid", "hybrid", 2, 9),
        ("cpu", "offload", "fill", 0, 5),
        _gpu("offload", "stream", 2, 9),
        _gpu("hybrid", "hybrid", 2, 9),
    ],
)
def test_prefill_strategies_over_quantized_experts(built, device, mode, strategy, buffers, num_slots):
    """Prefill chunks streamed into layer buffers of the format's bytes (`LayerStreamer`), or served on demand:
    the dequantized float model's logits."""
    from test_prefill import PROMPT, _chunked_logits

    _on(device, built)
    q, deq, _ = built
    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    want = _chunked_logits(load_checkpoint(deq, FusedExperts(), device, dtype), PROMPT, len(PROMPT))
    pool = build_expert_pool(ModelConfig.from_dir(q), q)
    backend = ExpertCacheBackend(
        mode, pool, device, num_slots, cpu_threads=2, layer_buffers=buffers, prefill_strategy=strategy, **PROFILE
    )
    model = load_checkpoint(q, backend, device, dtype)
    _chunked_logits(model, PROMPT[:3], 1, prefill=False)  # some slots warm, so streamed layers mix slots and buffers
    got = _chunked_logits(model, PROMPT, 8)
    cpu_ran = sum(backend.stats()["layers"]["cpu_runs"]) > 0
    tol = (_cpu_tol(backend.stats()) if cpu_ran else 1e-5) if device.type == "cpu" else 3e-2
    assert (got - want).abs().max().item() <= tol * want.abs().max().item()
    assert backend.stats()["prefill"]["steps_by_strategy"][strategy] > 0
    if strategy == "stream":
        assert backend.stats()["prefill"]["bytes_streamed"] > 0
