"""The Rust side of the quantized formats (`freetoken._core`): the layout table agrees with Python's, the Rust
codecs dequantize pool bytes to the torch reference bit for bit, every CPU kernel path matches a torch
dequantize-then-matmul reference, and a quantized pool holds the checkpoint's bytes at its real size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import freetoken.engine  # noqa: F401  (before freetoken.models.loader, which imports only after the engine)
from freetoken import _core
from freetoken.config import ModelConfig
from freetoken.quant import BF16, MXFP4, NVFP4, fp8_block, quant_spec
from freetoken.quant import reference as ref
from freetoken.quant.checkpoint import build_quantized_checkpoint, fill_pool

FORMATS = [fp8_block(), fp8_block(16, 32), NVFP4, MXFP4]
IDS = ["fp8_128", "fp8_16x32", "nvfp4", "mxfp4"]


def _block(fmt):
    return (fmt.block_rows, fmt.block_cols) if fmt.name == "fp8_block" else (0, 0)


def _expert(fmt, h: int, i: int, seed: int) -> torch.Tensor:
    """One expert quantized by the reference quantizer from N(0, 0.05) weights, packed in the pool layout."""
    gen = torch.Generator().manual_seed(seed)
    gate, up, down = (torch.randn(r, c, generator=gen) * 0.05 for r, c in ((i, h), (i, h), (h, i)))
    parts = [ref.quantize_matrix(fmt, w) for w in (gate, up, down)]
    return ref.pack_expert(fmt.layout(h, i), *parts)


@pytest.mark.parametrize("fmt", [BF16, *FORMATS], ids=["bf16", *IDS])
@pytest.mark.parametrize(("h", "i"), [(2048, 768), (4096, 1536), (256, 128)])
def test_layout_tables_agree(fmt, h, i):
    py = fmt.layout(h, i)
    rust = _core.expert_layout(fmt.name, h, i, _block(fmt))
    assert rust.pop("expert_nbytes") == py.expert_nbytes
    assert rust == py.sections


def test_unsupported_formats_are_refused():
    with pytest.raises(_core.FreetokenError, match="not one of bf16, fp8_block"):
        _core.expert_layout("int4", 64, 32)
    with pytest.raises(_core.FreetokenError, match="does not split into whole nvfp4 blocks"):
        _core.expert_layout("nvfp4", 64, 24)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_rust_dequantizes_like_the_reference_bit_for_bit(fmt):
    h, i = 256, 128
    packed = _expert(fmt, h, i, 0)
    gate_up, down = _core.dequantize_expert(fmt.name, h, i, packed.numpy(), _block(fmt))
    want_gate_up, want_down = ref.dequantize_experts(fmt.layout(h, i), packed[None])
    assert torch.equal(torch.from_numpy(gate_up).view(2 * i, h), want_gate_up[0])
    assert torch.equal(torch.from_numpy(down).view(h, i), want_down[0])


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("isa", _core.supported_isas())
@pytest.mark.parametrize("n", [1, 3, 5])
def test_cpu_kernels_match_torch_dequantize_then_matmul(fmt, isa, n):
    """float64 torch reference on the dequantized weights; the kernels sum in float32 in another order (and scale
    block sums, not weights): within 1e-4 of the output's largest value. The bf16 paths round ``x`` and
    ``silu(g) * u`` to bf16, and so does the reference for them; their float32 ``silu(g) * u`` can round to the
    other bf16 neighbour of the reference's float64 one (a 2^-8 relative step of one input): within 5e-4."""
    h, i = 256, 128
    packed = _expert(fmt, h, i, 1)
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(n))
    got = _core.quantized_expert_forward(fmt.name, h, i, packed.numpy(), x.numpy(), isa, _block(fmt))
    gate_up, down = (w[0].double() for w in ref.dequantize_experts(fmt.layout(h, i), packed[None]))
    bf16 = isa in ("avx512_bf16", "amx_bf16")
    rounded = (lambda t: t.to(torch.bfloat16).double()) if bf16 else (lambda t: t)
    gate, up = F.linear(rounded(x.double()), gate_up).chunk(2, dim=-1)
    want = F.linear(rounded(F.silu(gate) * up), down)
    tol = 5e-4 if bf16 else 1e-4
    torch.testing.assert_close(torch.from_numpy(got).view(n, h).double(), want, atol=tol * want.abs().max(), rtol=0)


def test_quantized_pool_holds_the_checkpoint_at_its_real_size(tmp_path):
    fmt = fp8_block(32, 32)
    src = build_quantized_checkpoint(tmp_path / "q", fmt, seed=2, vocab_size=2048, num_hidden_layers=2)
    cfg = ModelConfig.from_dir(src)
    spec = quant_spec(cfg.raw, src)
    pool = _core.ExpertPool.zeroed(
        len(cfg.moe_layers),
        cfg.num_experts,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        format="fp8_block",
        block=(32, 32),
        moe_layers=cfg.moe_layers,
    )
    layout = fmt.layout(cfg.hidden_size, cfg.moe_intermediate_size)
    assert pool.format == "fp8_block" and pool.expert_nbytes == layout.expert_nbytes == cfg.expert_nbytes
    assert pool.expert_nbytes < 0.6 * 2 * cfg.expert_numel  # about half of bf16 (plus the scales)
    fill_pool(pool, src, cfg, spec)
    experts = np.stack([pool.expert_view(1, e) for e in range(cfg.num_experts)])
    _gate_up, down = ref.dequantize_experts(layout, torch.from_numpy(experts))
    tensors = load_file(src / "model.safetensors")
    name = f"model.layers.{cfg.moe_layers[1]}.mlp.experts.5."
    want = ref.dequantize_fp8_block(
        tensors[name + "down_proj.weight"], tensors[name + "down_proj.weight_scale_inv"], (32, 32)
    )
    assert torch.equal(down[5], want)
    # The layer step's host experts read the pool's FP8 bytes (the quantized kernels in the worker split).
    x = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    out = np.zeros((2, cfg.hidden_size), dtype=np.float32)
    ids, weights = np.array([[5], [5]]), np.array([[1.0], [0.5]], dtype=np.float32)
    cpu = _core.CpuExperts(pool, num_threads=2)
    cpu.forward(1, x.numpy(), ids, weights, np.array([5]), out)
    # The bf16 paths round the experts' inputs (x, silu(g) * u) to bf16: the reference does too.
    rounded = (lambda t: t.bfloat16().float()) if cpu.isa in ("avx512_bf16", "amx_bf16") else (lambda t: t)
    g, u = (rounded(x) @ _gate_up[5].T).chunk(2, dim=-1)
    y = rounded(torch.nn.functional.silu(g) * u) @ down[5].T
    torch.testing.assert_close(torch.from_numpy(out), y * torch.tensor([[1.0], [0.5]]), rtol=1e-3, atol=1e-4)
    with pytest.raises(_core.FreetokenError, match="quantized checkpoint"):
        _core.ExpertPool.from_checkpoint(src)
