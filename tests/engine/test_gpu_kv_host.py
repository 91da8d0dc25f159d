"""On a CUDA device, the KV prefix cache's host tier (`freetoken.engine.kv_host`): pinned host memory, copies on a
side stream ordered before the attention that reads them. Sessions that evict each other from a tiny GPU KV
budget give the greedy tokens of a cold engine (`no_prefix_cache`), CUDA-graph decode included, with the blocks
copied back (every host hit promoted) and with the engine's own measured crossover; a KV resize keeps the tier.

Skipped without a GPU (CI); on the GPU box: `python -m pytest tests/engine/test_gpu_kv_host.py -v -s`.
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_prefix_cache import _run

from freetoken.config import EngineConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.resize import resize
from freetoken.models.demo import build_demo_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KV = dict(kv_cache_tokens=320, max_model_len=192)  # 20 blocks of 16: about one session's history


def _engines(path, **kwargs) -> tuple[LLMEngine, LLMEngine]:
    make = lambda **kw: LLMEngine.from_dir(
        path, EngineConfig(device="cuda", dtype="float32", moe_backend="fused", **KV, **kw, **kwargs)
    )
    return make(kv_host_gb=0.05), make(no_prefix_cache=True)


def _sessions(cached: LLMEngine, cold: LLMEngine, turns: int = 3) -> list[list[int]]:
    """Three sessions, their turns interleaved and then all three at once; asserts each answer equals cold's."""
    sessions = [[(53 * i + 11 * s) % 9000 + 100 for i in range(60 + 7 * s)] for s in range(3)]
    cached_tokens: list[list[int]] = [[] for _ in sessions]
    for _turn in range(turns):
        for s, history in enumerate(sessions):
            before = cached.scheduler.prefix_cache.num_hit_tokens
            got, _ = _run(cached, [history], 12)
            want, _ = _run(cold, [history], 12)
            assert got == want, s
            cached_tokens[s].append(cached.scheduler.prefix_cache.num_hit_tokens - before)
            sessions[s] = history + got[0] + [5, 6, 7]
    together, _ = _run(cached, [h[:150] for h in sessions], 12)
    for s, history in enumerate(sessions):
        want, _ = _run(cold, [history[:150]], 12)
        assert together[s] == want[0], f"concurrent {s}"
    return cached_tokens


def test_host_tier_promotes_and_equals_cold(tmp_path):
    """Every host hit promoted (the copy path under test): later turns reuse their whole history from the host."""
    path = build_demo_checkpoint(tmp_path / "demo", seed=21)
    cached, cold = _engines(path)
    tier = cached.kv_host
    assert tier is not None and tier.stream is not None and None not in tier._regions  # pinned, side stream
    tier.cost.worth_promoting = lambda num_tokens: True  # type: ignore[method-assign]
    decode = cached.runner.decode
    assert decode is not None and (decode.graphs or getattr(decode, "span_graphs", None)), "no CUDA graphs captured"
    counts = _sessions(cached, cold)
    stats = cached.stats()["kv_host"]
    print("kv_host:", stats)
    assert stats["num_promoted_blocks"] > 0 and stats["num_demoted_blocks"] > 0
    assert all(c[-1] >= 60 for c in counts), counts  # the last turn of each session: its history came back
    assert stats["h2d_gbps"] > 1


def test_host_tier_with_the_measured_crossover_equals_cold(tmp_path):
    """The engine's own decision (the measured prefill cost against the copy): promoted or recomputed, exact."""
    path = build_demo_checkpoint(tmp_path / "demo", seed=22)
    cached, cold = _engines(path)
    _sessions(cached, cold)
    stats = cached.stats()["kv_host"]
    print("kv_host (measured crossover):", stats)
    assert stats["prefill_samples"] > 0 and stats["copy_fixed_us"] > 0 and stats["h2d_gbps"] > 1
    assert stats["crossover_tokens"] is None or stats["crossover_tokens"] > 0
    assert stats["num_promoted_blocks"] + stats["num_skipped_tokens"] > 0


def test_host_tier_survives_a_kv_resize(tmp_path):
    path = build_demo_checkpoint(tmp_path / "demo", seed=23)
    cached, cold = _engines(path)
    cached.kv_host.cost.worth_promoting = lambda num_tokens: True  # type: ignore[method-assign,union-attr]
    history = [(31 * i) % 9000 + 100 for i in range(170)]
    _run(cached, [history], 8)
    _run(cached, [[t + 1 for t in history]], 8)  # pushes the first history to the host
    live = cached.kv_host.num_live  # type: ignore[union-attr]
    on_gpu = cached.scheduler.prefix_cache.num_cached_blocks
    resize(cached, kv_blocks=12)  # smallest that holds a 192-token context: the rest goes to the host
    assert cached.kv_host.num_live == live + max(0, on_gpu - 12)  # type: ignore[union-attr]
    for prompt in (history + [9, 9], [t + 1 for t in history] + [9]):
        got, _ = _run(cached, [prompt], 12)
        want, _ = _run(cold, [prompt], 12)
        assert got == want
    assert cached.kv_host.num_promoted_blocks > 0  # type: ignore[union-attr]
