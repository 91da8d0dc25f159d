"""On a CUDA device, through the engine with CUDA-graph decode: requests that start from the KV prefix cache give
the greedy tokens of the same request on a cold engine (`no_prefix_cache`).

The cases: a second turn (history + new tokens), a strict prefix of a cached sequence (block-aligned, so entirely
cached: the last position is recomputed into a copy of the last block, through the decode graph; and not
aligned), an edit in the middle, the same prompt resent, n = 3 identical prompts at once (sharing blocks while
one computes them), and many sessions through a small KV budget (evictions).

Skipped without a GPU (CI); on the GPU box: `python -m pytest tests/engine/test_gpu_prefix_cache.py -v`.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import build_demo_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BASE = [(37 * i) % 9000 + 100 for i in range(70)]  # 70 tokens: 4 full blocks of 16 and 6 more


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list]]:
    """Greedy tokens of `prompts` added at once, and per prompt its (token, logprob, top-2 logprobs) rows."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    base = engine.num_steps
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{base}-{i}", prompt, params)
    out: dict[str, list] = {f"{base}-{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend((lp.token_id, lp.logprob, [v for _, v in lp.top]) for lp in o.chunk.logprobs)
    rows = [out[f"{base}-{i}"] for i in range(len(prompts))]
    return [[t for t, _, _ in r] for r in rows], rows


def _cases(cached: LLMEngine) -> list[tuple[str, list[list[int]]]]:
    """The requests, built on what `cached` generates for BASE (run first, so the cache holds it)."""
    first, _ = _run(cached, [BASE], 30)
    history = BASE + first[0]  # 100 tokens, 99 with K/V
    edited = list(history)
    edited[40] += 1
    return [
        ("second turn", [history + [11, 12, 13, 14, 15]]),
        ("strict prefix, block-aligned (all cached)", [history[:64]]),
        ("strict prefix, not aligned", [history[:75]]),
        ("edit in the middle", [edited]),
        ("same prompt again", [BASE]),
        ("n = 3 at once", [history + [21, 22]] * 3),
    ]


def _engines(path, dtype: str, backend: str, **kwargs) -> tuple[LLMEngine, LLMEngine]:
    make = lambda off: LLMEngine.from_dir(
        path,
        EngineConfig(device="cuda", dtype=dtype, kv_cache_gb=0.5, moe_backend=backend, no_prefix_cache=off, **kwargs),
    )
    cached, cold = make(False), make(True)
    decode = cached.runner.decode
    assert decode is not None and decode.captured, "no CUDA graphs captured"
    return cached, cold


@pytest.mark.parametrize("backend,extra", [("fused", {})])
def test_cached_equals_cold_float32(tmp_path, backend, extra):
    """float32: every case gives exactly the cold engine's tokens (fused only: the slot kernels of the expert-cache
    backends take bfloat16 activations, so offload is checked in bfloat16 below)."""
    path = build_demo_checkpoint(tmp_path / "demo", seed=11)
    cached, cold = _engines(path, "float32", backend, **extra)
    for name, prompts in _cases(cached):
        got, _ = _run(cached, prompts, 24)
        want, _ = _run(cold, prompts[:1], 24)
        assert got == want * len(prompts), name
    stats = cached.stats()["prefix_cache"]
    assert stats["num_hit_tokens"] > 0


def _near_tie(top: list[float]) -> bool:
    """The two most likely tokens equal to bf16 rounding of the logits (as tests/engine/test_gpu.py's `_close`)."""
    return abs(top[0] - top[1]) <= 0.05 + 0.02 * abs(top[0])


@pytest.mark.parametrize("backend,extra", [("fused", {}), ("offload", {"expert_slots": 64})])
def test_cached_equals_cold_bfloat16(tmp_path, backend, extra):
    """bfloat16: the same tokens as cold. A prefill from cached K/V multiplies fewer rows than a cold one, and the
    GEMMs may round the last bit of a row differently with its batch's shape; so a sequence may part from cold's
    only where cold's top two tokens were a near-tie (reported), and most must match all the way."""
    path = build_demo_checkpoint(tmp_path / "demo", seed=12)
    cached, cold = _engines(path, "bfloat16", backend, **extra)
    total = exact = 0
    for name, prompts in _cases(cached):
        got, _ = _run(cached, prompts, 24)
        want, rows = _run(cold, prompts[:1], 24)
        for tokens in got:
            total += 1
            first = next((i for i, (a, b) in enumerate(zip(tokens, want[0], strict=False)) if a != b), None)
            if first is None:
                exact += 1
                continue
            top = rows[0][first][2]
            assert _near_tie(top), f"{name}: differs at step {first} where cold's top-2 {top} is no tie"
            print(f"{name}: differs at step {first}, at a near-tie of cold's top two {top}")
    assert exact >= total - 1, f"only {exact} of {total} sequences equal cold's"


def test_many_sessions_through_a_small_kv_budget(tmp_path):
    """float32, fused: six sessions of two turns through 384 tokens of KV (evictions) equal their cold runs."""
    path = build_demo_checkpoint(tmp_path / "demo", seed=13)
    cached, cold = _engines(path, "float32", "fused", kv_cache_tokens=384, max_model_len=192)
    sessions = [[(53 * i + 7 * s) % 9000 + 100 for i in range(40 + 5 * s)] for s in range(6)]
    for _turn in range(2):
        for s, history in enumerate(sessions):
            got, _ = _run(cached, [history], 16)
            want, _ = _run(cold, [history], 16)
            assert got == want, s
            sessions[s] = history + got[0] + [5, 6, 7]
    stats = cached.stats()["prefix_cache"]
    assert stats["num_evictions"] > 0 and stats["num_hit_tokens"] > 0
