"""freetoken._core.CpuExperts against torch, on every kernel path this CPU supports.

Run: python -m pytest tests/rust/test_core_cpu.py
"""

from __future__ import annotations

import numpy as np
import pytest

from freetoken import _core

torch = pytest.importorskip("torch")

# Tolerances, relative to the largest |output|: fp32 activations (scalar, avx2) differ from
# torch only by summation order; avx512_bf16 and amx_bf16 round activations to bf16 first.
# (96, 73) shapes reach the AMX tiles (cols a multiple of 32, >= 16 rows, >= 4 tokens).
TOL = {"scalar": 1e-4, "avx2": 1e-4, "avx512_bf16": 2e-2, "amx_bf16": 2e-2}


def _weights(pool: _core.ExpertPool, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, i = pool.hidden_size, pool.intermediate_size
    t = torch.frombuffer(pool.expert_view(layer, expert), dtype=torch.bfloat16).float()
    return t[: 2 * i * h].view(2 * i, h), t[2 * i * h :].view(h, i)


def _reference(pool, layer, x, ids, weights, experts) -> torch.Tensor:
    out = torch.zeros_like(x)
    i = pool.intermediate_size
    for e in experts:
        gate_up, down = _weights(pool, layer, int(e))
        tok, pos = (ids == e).nonzero(as_tuple=True)
        if len(tok) == 0:
            continue
        gu = x[tok] @ gate_up.T
        y = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]) @ down.T
        out.index_add_(0, tok, y * weights[tok, pos, None])
    return out


@pytest.mark.parametrize("isa", _core.supported_isas())
@pytest.mark.parametrize("batch,hidden,inter", [(1, 64, 32), (5, 67, 33), (16, 96, 511 // 7)])
def test_forward_matches_torch(isa: str, batch: int, hidden: int, inter: int) -> None:
    num_experts, k = 8, 2
    pool = _core.ExpertPool.random(2, num_experts, hidden, inter, seed=batch)
    cpu = _core.CpuExperts(pool, num_threads=2, isa=isa)
    assert cpu.isa == isa and cpu.num_threads == 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, hidden, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(batch)])
    weights = torch.rand(batch, k, generator=g)
    experts = np.array([0, 2, 3, 5, 7], dtype=np.int32)
    out = np.full((batch, hidden), 0.25, dtype=np.float32)
    cpu.forward(1, x.numpy(), ids.numpy(), weights.numpy(), experts, out)
    want = _reference(pool, 1, x, ids, weights, experts) + 0.25
    err = (torch.from_numpy(out) - want).abs().max().item()
    scale = (want - 0.25).abs().max().item()
    assert err <= TOL[isa] * scale, (err, scale)
    # bf16 hidden (bits as int16, as torch gives them) agrees with fp32 hidden rounded to bf16.
    xb = x.to(torch.bfloat16)
    out2 = np.zeros((batch, hidden), dtype=np.float32)
    cpu.forward(1, xb.view(torch.int16).numpy(), ids.numpy(), weights.numpy(), experts, out2)
    want2 = _reference(pool, 1, xb.float(), ids, weights, experts)
    assert (torch.from_numpy(out2) - want2).abs().max().item() <= TOL[isa] * scale


def test_forward_matches_transformers_experts(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    pool = _core.ExpertPool.from_checkpoint(str(tmp_path))
    experts = model.model.layers[1].mlp.experts.float()
    x = torch.randn(3, 64)
    ids = torch.tensor([[0, 1], [1, 5], [7, 0]])
    w = torch.rand(3, 2)
    with torch.no_grad():
        want = experts(x, ids, w)
    out = np.zeros((3, 64), dtype=np.float32)
    _core.CpuExperts(pool, isa="scalar").forward(1, x.numpy(), ids.numpy(), w.numpy(), np.arange(8), out)
    assert np.allclose(out, want.numpy(), rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_forward_errors() -> None:
    pool = _core.ExpertPool.random(1, 4, 32, 16)
    cpu = _core.CpuExperts(pool)
    x = np.zeros((2, 32), np.float32)
    ids = np.zeros((2, 2), np.int64)
    w = np.ones((2, 2), np.float32)
    out = np.zeros((2, 32), np.float32)
    with pytest.raises(IndexError):
        cpu.forward(1, x, ids, w, [0], out)
    with pytest.raises(IndexError):
        cpu.forward(0, x, ids, w, [4], out)
    with pytest.raises(ValueError, match="hidden"):
        cpu.forward(0, x[:1], ids, w, [0], out)
    with pytest.raises(ValueError, match="float32"):
        cpu.forward(0, x, ids, w.astype(np.float64), [0], out)
    with pytest.raises(ValueError, match="out"):
        cpu.forward(0, x, ids, w, [0], out.astype(np.float64))
    with pytest.raises(ValueError, match="twice"):
        cpu.forward(0, x, ids, w, [0, 0], out)
    with pytest.raises(ValueError, match="isa"):
        _core.CpuExperts(pool, isa="neon")


def test_forward_from_threads() -> None:
    """Calls from several Python threads (GIL released) are serialised and all correct."""
    import threading

    pool = _core.ExpertPool.random(1, 8, 64, 32, seed=5)
    cpu = _core.CpuExperts(pool, num_threads=2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64), dtype=np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 4], [5, 0]])
    w = np.full((4, 2), 0.5, np.float32)
    want = np.zeros((4, 64), np.float32)
    cpu.forward(0, x, ids, w, np.arange(8), want)
    outs = [np.zeros((4, 64), np.float32) for _ in range(4)]

    def work(o: np.ndarray) -> None:
        for _ in range(20):
            o[:] = 0
            cpu.forward(0, x, ids, w, np.arange(8), o)

    threads = [threading.Thread(target=work, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in outs:
        assert np.array_equal(o, want)


def test_idle_spin_keeps_results_and_rejects_bad_values() -> None:
    """Workers that poll between calls (`idle_spin_us`) give the same sums as parked ones; bad values are refused."""
    pool = _core.ExpertPool.random(2, 8, 64, 32, seed=3)
    cpu = _core.CpuExperts(pool, num_threads=3)
    assert cpu.idle_spin_us == 0.0
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 64), dtype=np.float32)
    ids = np.array([[0, 5], [2, 5], [7, 1]])
    w = np.full((3, 2), 0.5, np.float32)
    want = np.zeros((3, 64), np.float32)
    cpu.forward(1, x, ids, w, np.arange(8), want)
    cpu.idle_spin_us = 3000.0
    assert cpu.idle_spin_us == pytest.approx(3000.0)
    for _ in range(30):
        out = np.zeros_like(want)
        cpu.forward(1, x, ids, w, np.arange(8), out)
        assert np.array_equal(out, want)
    for bad in (-1.0, 2e6, float("nan")):
        with pytest.raises(ValueError, match="idle_spin_us"):
            cpu.idle_spin_us = bad
    cpu.idle_spin_us = 0.0
