"""freetoken._core.ExpertPool: layout, views, checkpoint loading and its errors.

Run: python -m pytest tests/rust/test_core_pool.py
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest

from freetoken import _core

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

H, I, E = 32, 24, 4  # 2I != H, so transposed fused tensors are unambiguous


def _expert(pool: _core.ExpertPool, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2I, H], down [H, I]) as bf16 tensors sharing the pool's memory."""
    h, i = pool.hidden_size, pool.intermediate_size
    t = torch.frombuffer(pool.expert_view(layer, expert), dtype=torch.bfloat16)
    return t[: 2 * i * h].view(2 * i, h), t[2 * i * h :].view(h, i)


def test_random_pool_shape_and_views() -> None:
    pool = _core.ExpertPool.random(2, E, H, I, seed=3, moe_layers=[1, 3])
    assert (pool.num_layers, pool.num_experts, pool.hidden_size, pool.intermediate_size) == (2, E, H, I)
    assert pool.moe_layers == [1, 3]
    assert pool.layer_index(3) == 1
    assert pool.expert_nbytes == 3 * I * H * 2
    assert pool.ptr % (2 << 20) == 0 and pool.nbytes % (2 << 20) == 0
    ptr, n = pool.expert_ptr(1, 2)
    assert n == pool.expert_nbytes and pool.ptr <= ptr < pool.ptr + pool.nbytes
    assert ptr - pool.ptr == pool.expert_offset(1, 2) == (1 * E + 2) * pool.expert_stride
    arena = np.asarray(pool.arena_view())
    view = np.asarray(pool.expert_view(1, 2))
    off = pool.expert_offset(1, 2)
    assert np.array_equal(arena[off : off + n], view)
    same = _core.ExpertPool.random(2, E, H, I, seed=3, moe_layers=[1, 3])
    assert np.array_equal(np.asarray(same.expert_view(0, 0)), np.asarray(pool.expert_view(0, 0)))
    gate_up, down = _expert(pool, 0, 1)
    assert gate_up.float().abs().max() <= 1 / H**0.5 * 1.01
    assert down.float().abs().max() > 0


def test_view_keeps_pool_alive() -> None:
    t = torch.frombuffer(_core.ExpertPool.random(1, 2, H, I, seed=1).expert_view(0, 1), dtype=torch.bfloat16)
    gc.collect()
    assert torch.isfinite(t.float()).all() and t.float().abs().sum() > 0


@pytest.mark.parametrize(
    "layer,expert",
    [(2, 0), (-1, 0), (0, E), (0, -1)],
)
def test_bad_indices_raise_index_error(layer: int, expert: int) -> None:
    pool = _core.ExpertPool.random(2, E, H, I)
    with pytest.raises(IndexError):
        pool.expert_ptr(layer, expert)
    with pytest.raises(_core.FreetokenError):
        pool.expert_view(layer, expert)


def test_bad_config_raises_value_error() -> None:
    with pytest.raises(ValueError, match="moe_layers has 1 entries"):
        _core.ExpertPool.random(2, E, H, I, moe_layers=[0])
    with pytest.raises(ValueError, match="every size must be positive"):
        _core.ExpertPool.random(2, 0, H, I)
    with pytest.raises(IndexError):
        _core.ExpertPool.random(2, E, H, I).layer_index(5)


def _config(d: Path, num_layers: int = 3, **extra: object) -> None:
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_experts": E,
        "num_hidden_layers": num_layers,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    }
    cfg.update(extra)
    (d / "config.json").write_text(json.dumps(cfg))


def _weights(seed: int, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        layer: (
            torch.randn(E, I, H, generator=g),  # gate
            torch.randn(E, I, H, generator=g),  # up
            torch.randn(E, H, I, generator=g),  # down
        )
        for layer in layers
    }


def _check_pool(pool: _core.ExpertPool, w: dict) -> None:
    assert pool.moe_layers == sorted(w)
    for pl, ml in enumerate(pool.moe_layers):
        gate, up, down = w[ml]
        for e in range(E):
            gu, dn = _expert(pool, pl, e)
            assert torch.equal(gu, torch.cat([gate[e], up[e]]).to(torch.bfloat16))
            assert torch.equal(dn, down[e].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_per_expert_sharded_checkpoint(tmp_path: Path, dtype: torch.dtype) -> None:
    _config(tmp_path)
    w = _weights(0, [0, 2])
    shards: dict[str, dict[str, torch.Tensor]] = {"a.safetensors": {}, "b.safetensors": {}}
    for ml, (gate, up, down) in w.items():
        for e in range(E):
            p = f"model.layers.{ml}.mlp.experts.{e}"
            s = shards["a.safetensors" if e % 2 else "b.safetensors"]
            s[f"{p}.gate_proj.weight"] = gate[e].to(dtype)
            s[f"{p}.up_proj.weight"] = up[e].to(dtype)
            s[f"{p}.down_proj.weight"] = down[e].to(dtype)
    shards["a.safetensors"]["model.embed_tokens.weight"] = torch.zeros(8, H)
    weight_map = {}
    for name, tensors in shards.items():
        safetensors_torch.save_file(tensors, str(tmp_path / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    pool = _core.ExpertPool.from_checkpoint(str(tmp_path), num_threads=2)
    if dtype == torch.bfloat16:
        _check_pool(pool, {k: tuple(t.to(dtype) for t in v) for k, v in w.items()})
    else:
        _check_pool(pool, {k: tuple(t.to(dtype).float() for t in v) for k, v in w.items()})


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_checkpoint(tmp_path: Path, transposed: bool) -> None:
    # a null quantization_config (as some exporters write for an unquantized model) is no quantization
    _config(tmp_path, num_layers=4, decoder_sparse_step=2, mlp_only_layers=[], quantization_config=None)
    w = _weights(1, [1, 3])
    tensors = {}
    for ml, (gate, up, down) in w.items():
        gu = torch.cat([gate, up], dim=1)  # [E, 2I, H]
        tensors[f"model.layers.{ml}.mlp.experts.gate_up_proj"] = (
            (gu.transpose(1, 2) if transposed else gu).contiguous().to(torch.bfloat16)
        )
        tensors[f"model.layers.{ml}.mlp.experts.down_proj"] = (
            (down.transpose(1, 2) if transposed else down).contiguous().to(torch.bfloat16)
        )
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    _check_pool(
        _core.ExpertPool.from_checkpoint(str(tmp_path)),
        {k: tuple(t.to(torch.bfloat16) for t in v) for k, v in w.items()},
    )


def test_transformers_checkpoint(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=I,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    pool = _core.ExpertPool.from_checkpoint(str(tmp_path))
    assert pool.moe_layers == [0, 2]
    for pl, ml in enumerate(pool.moe_layers):
        experts = model.model.layers[ml].mlp.experts
        for e in range(E):
            gu, dn = _expert(pool, pl, e)
            assert torch.equal(gu, experts.gate_up_proj[e].detach())
            assert torch.equal(dn, experts.down_proj[e].detach())


def _single(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    _config(tmp_path, num_layers=1, mlp_only_layers=[])
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))


def _good(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(E, 2 * I, H, dtype=dtype),
        "model.layers.0.mlp.experts.down_proj": torch.zeros(E, H, I, dtype=dtype),
    }


def test_loader_errors_name_file_and_tensor(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        _core.ExpertPool.from_checkpoint(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        _core.ExpertPool.from_checkpoint(str(tmp_path / "nope"))
    _config(tmp_path, num_layers=1, mlp_only_layers=[])
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        _core.ExpertPool.from_checkpoint(str(tmp_path))

    bad = _good()
    bad["model.layers.0.mlp.experts.down_proj"] = torch.zeros(E, H, I + 1, dtype=torch.bfloat16)
    _single(tmp_path, bad)
    with pytest.raises(_core.CheckpointError, match=r"down_proj.*shape"):
        _core.ExpertPool.from_checkpoint(str(tmp_path))

    _single(tmp_path, _good(torch.int32))
    with pytest.raises(ValueError, match=r"model.safetensors.*gate_up_proj.*dtype"):
        _core.ExpertPool.from_checkpoint(str(tmp_path))

    only = _good()
    del only["model.layers.0.mlp.experts.down_proj"]
    _single(tmp_path, only)
    with pytest.raises(_core.CheckpointError, match=r"model\.layers\.0\.mlp\.experts\.down_proj"):
        _core.ExpertPool.from_checkpoint(str(tmp_path))

    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(_good(), "missing-shard.safetensors")})
    )
    with pytest.raises(FileNotFoundError, match=r"missing-shard\.safetensors"):
        _core.ExpertPool.from_checkpoint(str(tmp_path))
