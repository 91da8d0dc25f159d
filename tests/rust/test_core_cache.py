"""freetoken._core SlotMap, Planner and routing traces.

Run: python -m pytest tests/rust/test_core_cache.py
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from freetoken import _core


def test_slot_map_lru_pins_and_resize() -> None:
    m = _core.SlotMap(2, num_layers=2, num_experts=8, policy="lru")
    assert (m.capacity, len(m), m.policy) == (2, 0, "lru")
    assert m.insert(0, 1) == (0, None)
    assert m.insert(0, 2) == (1, None)
    assert m.is_pinned(0) and m.is_pinned(1)
    with pytest.raises(_core.ExpertCacheFullError):
        m.insert(1, 3)
    m.unpin_all()
    assert m.touch(0, 1) == 0
    m.unpin_all()
    assert m.insert(1, 3) == (1, (0, 2))
    assert m.get(0, 2) is None and m.get(1, 3) == 1
    m.unpin_all()
    moves = m.resize(1)
    assert moves.shape[1] == 4 and len(m) == 1
    assert sorted(m.residents()) == [(1, 3, 0)]
    assert m.resize(4).shape == (0, 4)
    with pytest.raises(IndexError):
        m.get(2, 0)
    with pytest.raises(ValueError, match="unknown expert_cache policy"):
        _core.SlotMap(2, 2, 8, policy="fifo")


def test_slot_map_threads() -> None:
    m = _core.SlotMap(64, num_layers=4, num_experts=32, policy="layer_lru")

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(2000):
            layer, expert = int(rng.integers(4)), int(rng.integers(32))
            if m.touch(layer, expert) is None:
                try:
                    m.insert(layer, expert)
                except _core.ExpertCacheFullError:
                    pass
            if rng.random() < 0.2:
                m.unpin_all()

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    slots = [s for _, _, s in m.residents()]
    assert len(slots) == len(set(slots)) == len(m) <= 64


def _planner(capacity: int = 8, **kw: object) -> _core.Planner:
    return _core.Planner(num_layers=2, num_experts=16, expert_nbytes=1000, capacity=capacity, **kw)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_planner_offload(dtype: type) -> None:
    p = _planner()
    ids = np.array([[1, 2], [2, 3]], dtype=dtype)
    plan = p.plan(0, ids, "offload")
    assert plan.fill_experts.tolist() == [1, 2, 3]
    assert plan.fill_slots.dtype == np.int32
    assert plan.topk_slots.shape == (2, 2)
    assert plan.topk_slots.tolist() == [[0, 1], [1, 2]]
    assert plan.victim_experts.tolist() == [-1, -1, -1]
    plan = p.plan(0, ids, "offload")
    assert plan.hit_experts.tolist() == [1, 2, 3] and plan.num_fills == 0
    s = p.stats()
    assert s["hits"].tolist() == [3, 0] and s["fills"].tolist() == [3, 0]
    assert s["bytes_h2d"].tolist() == [3000, 0] and s["steps"].tolist() == [2, 0]
    p.reset_stats()
    assert p.stats()["hits"].tolist() == [0, 0]
    assert p.slot_of(0, 3) == 2 and p.num_resident == 3


def test_planner_cpu_and_hybrid() -> None:
    p = _planner(16, pcie_bytes_per_s=1e9, cpu_bytes_per_s={1: 1e9, 16: 4e9}, reuse_weight=0.0)
    plan = p.plan(1, np.arange(8).reshape(1, 8), "cpu")
    assert plan.cpu_experts.tolist() == list(range(8)) and plan.q == 1.0
    assert (plan.topk_slots == -1).all()
    plan = p.plan(0, np.arange(8).reshape(1, 8), "hybrid")
    assert plan.num_cpu == 4 and plan.num_fills == 4 and abs(plan.q - 0.5) < 1e-9
    assert p.q_star(1) == pytest.approx(0.5)
    assert p.stats()["cpu_runs"].tolist() == [4, 8]


def test_planner_errors() -> None:
    p = _planner()
    with pytest.raises(ValueError, match="hybrid"):
        p.plan(0, np.zeros((1, 2), np.int64), "hybrid")
    with pytest.raises(ValueError, match="backend"):
        p.plan(0, np.zeros((1, 2), np.int64), "gpu")
    with pytest.raises(IndexError):
        p.plan(2, np.zeros((1, 2), np.int64))
    with pytest.raises(IndexError):
        p.plan(0, np.array([[0, 16]]))
    with pytest.raises(ValueError, match=r"topk_ids must be \[B, k\]"):
        p.plan(0, np.zeros((1, 2, 2), np.int64))
    with pytest.raises(ValueError, match="must be given together"):
        _planner(pcie_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="needs a positive B_pcie"):
        _planner(pcie_bytes_per_s=-1.0, cpu_bytes_per_s={1: 1e9})


def test_planner_resize_keeps_residents() -> None:
    p = _planner(8)
    p.plan(0, np.arange(8).reshape(1, 8))
    moves = p.resize(4)
    assert p.capacity == 4 and p.num_resident == 4
    assert (moves[:, 2] >= 4).all() and (moves[:, 3] < 4).all()
    assert p.plan(0, np.arange(4, 8).reshape(1, 4)).num_hits == 4


def test_trace_roundtrip_and_simulation(tmp_path: Path) -> None:
    path = tmp_path / "t.fttrace"
    with _core.TraceWriter(str(path), num_layers=2, num_experts=8, top_k=2) as w:
        for step in range(3):
            for layer in range(2):
                w.record(step, layer, np.array([[step, layer + 4]], dtype=np.int64))
    t = _core.read_trace(str(path))
    assert (t["num_layers"], t["num_experts"], t["top_k"]) == (2, 8, 2)
    assert len(t["records"]) == 6
    step, layer, ids = t["records"][3]
    assert (step, layer, ids.tolist()) == (1, 1, [[1, 5]])
    r = _core.simulate_trace(str(path), capacity=16, policy="lru")
    assert r["hits"] + r["misses"] == 12 and r["hits"] == 4
    (tmp_path / "bad").write_bytes(b"nope")
    with pytest.raises(_core.TraceFormatError):
        _core.read_trace(str(tmp_path / "bad"))
    with pytest.raises(FileNotFoundError):
        _core.read_trace(str(tmp_path / "missing"))
    w = _core.TraceWriter(str(path), 2, 8, 2)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        w.record(0, 2, np.array([[0, 1]]))
    with pytest.raises(ValueError, match="expert id 8 out of range"):
        w.record(0, 0, np.array([[0, 8]]))


def test_synthetic_trace_policies(tmp_path: Path) -> None:
    path = tmp_path / "s.fttrace"
    _core.synthetic_trace(str(path), num_layers=4, num_experts=64, top_k=8, num_steps=300, seed=1)
    rate = {
        p: _core.simulate_trace(str(path), capacity=4 * 32, policy=p, warmup=40)["hit_rate"]
        for p in ("lru", "layer_lru", "lfu", "min")
    }
    assert all(0.3 < rate[p] <= rate["min"] <= 1.0 for p in ("lru", "layer_lru", "lfu")), rate


@pytest.mark.parametrize("policy", ["lru", "layer_lru", "lfu"])
def test_policies_resize_and_pins(policy: str) -> None:
    m = _core.SlotMap(8, num_layers=2, num_experts=16, policy=policy)
    for e in range(8):
        m.insert(e % 2, e)
    with pytest.raises(_core.ExpertCacheFullError):
        m.insert(0, 15)
    m.unpin_all()
    assert m.insert(0, 15)[1] is not None
    m.unpin_all()
    m.resize(3)
    assert len(m) == 3 and all(s < 3 for _, _, s in m.residents())
