"""On a CUDA device: the same engine gives the CPU's greedy tokens, and bfloat16 follows transformers.

Skipped without a GPU (CI); run on the GPU box with `python -m pytest tests/engine/test_gpu.py`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.cuda_graph import DrivenGraphRunner
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import build_demo_checkpoint
from greedy import follows_reference_bf16, greedy_tokens
from reference import make_reference_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[3, 17, 100, 42, 7, 8, 9, 200, 13], [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
# Four prompts of different lengths (the long one as benches/diag_hybrid_offload.py's), for the eviction tests.
EVICTION_PROMPTS = [
    PROMPTS[0],
    [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 5,
    list(range(1000, 1030)),
    [77, 78, 79, 80] * 6,
]


def _greedy(path, device: str, dtype: str, prompts, max_tokens: int, **engine_args) -> list[list[int]]:
    engine = LLMEngine.from_dir(
        path, EngineConfig(device=device, dtype=dtype, kv_cache_gb=0.5, moe_backend="fused", **engine_args)
    )
    return greedy_tokens(engine, prompts, max_tokens)


def test_demo_greedy_on_cuda_equals_cpu(tmp_path):
    """CUDA (Triton kernels, CUDA-graph decode) against the CPU's torch path, both float32."""
    path = build_demo_checkpoint(tmp_path / "demo", seed=3)
    assert _greedy(path, "cuda", "float32", PROMPTS, 32) == _greedy(path, "cpu", "float32", PROMPTS, 32)


def test_cuda_graph_decode_equals_torch_path(tmp_path):
    """float32: the captured decode step gives the tokens of the eager torch attention path (max_num_seqs
    above 64 sends a batch of 65 through the eager path)."""
    path = build_demo_checkpoint(tmp_path / "demo", seed=4)
    prompts = [[(7 * i + j) % 5000 + 1 for j in range(5 + i % 7)] for i in range(65)]
    graphs = _greedy(path, "cuda", "float32", prompts[:8], 24)
    eager = _greedy(path, "cuda", "float32", prompts, 24, max_num_seqs=65)
    assert graphs == eager[:8]


def test_bfloat16_greedy_follows_transformers(tmp_path):
    """16 greedy steps in bfloat16 equal transformers' on the same GPU, except from a near-tie
    (`greedy.follows_reference_bf16`); most sequences match all 16 steps."""
    full = total = 0
    for seed in range(4):
        ref = make_reference_checkpoint(tmp_path / f"ref{seed}", seed=seed, lm_head_std=0.6).to("cuda", torch.bfloat16)
        got = _greedy(tmp_path / f"ref{seed}", "cuda", "bfloat16", PROMPTS, 16)
        full += follows_reference_bf16(ref, PROMPTS, got, 16, f"seed {seed}")
        total += len(PROMPTS)
    assert full >= total - 2, f"only {full} of {total} sequences matched all 16 steps"


@pytest.mark.parametrize("layers_per_graph", [4, 1])
def test_offload_driven_graphs_equal_fused(tmp_path, monkeypatch, layers_per_graph):
    """bfloat16 on CUDA: offload (host pool, slot cache, the whole decode step in CUDA graphs served by the decode
    driver thread) gives fused's greedy tokens; its slot runs use the same Triton kernel on the same bf16 weights,
    so the tokens are the same bits. The demo's 4 MoE layers make one graph part, or four with one layer per part
    (the next part launched while the one before still waits on the driver). (With fewer slots than a token's
    experts, picks also run on the CPU: see `test_driven_host_experts_follow_fused`.)"""
    from freetoken.engine import cuda_graph

    monkeypatch.setattr(cuda_graph, "LAYERS_PER_GRAPH", layers_per_graph)
    slots = 64
    path = build_demo_checkpoint(tmp_path / "demo", seed=6)
    fused = _greedy(path, "cuda", "bfloat16", PROMPTS, 16)
    engine = LLMEngine.from_dir(
        path, EngineConfig(device="cuda", dtype="bfloat16", kv_cache_gb=0.5, moe_backend="offload", expert_slots=slots)
    )
    assert isinstance(engine.runner.decode, DrivenGraphRunner) and engine.runner.decode.captured
    assert len(engine.runner.decode.parts) == (1 if layers_per_graph == 4 else 4)
    assert greedy_tokens(engine, PROMPTS, 16) == fused
    stats = engine.experts.stats()["layers"]
    assert sum(stats["steps"]) >= 16 * len(engine.experts.pool_layer)


@pytest.fixture(scope="module")
def eviction_demo(tmp_path_factory):
    """A 16-expert, top-4 demo (64 routed experts in 4 layers) and fused's greedy tokens of its first 1 and 4
    `EVICTION_PROMPTS`, {num_prompts: tokens}."""
    path = build_demo_checkpoint(
        tmp_path_factory.mktemp("evict") / "demo", seed=6, num_experts=16, num_experts_per_tok=4
    )
    fused = {n: _greedy(path, "cuda", "bfloat16", EVICTION_PROMPTS[:n], 16, max_num_seqs=4) for n in (1, 4)}
    return path, fused


def _copy_stream_delays():
    """`CopyStreamDelays` of benches/diag_evict_stress.py (one definition, used by the bench and this test)."""
    import importlib.util

    bench = Path(__file__).resolve().parents[2] / "benches" / "diag_evict_stress.py"
    spec = importlib.util.spec_from_file_location("diag_evict_stress", bench)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CopyStreamDelays


@pytest.mark.parametrize("num_prompts", [1, 4])
@pytest.mark.parametrize("slots,prefill", [(32, "auto"), (16, "fill"), (24, "stream")])
def test_offload_driven_graphs_equal_fused_under_evictions(eviction_demo, num_prompts, slots, prefill):
    """As `test_offload_driven_graphs_equal_fused`, with 16-32 slots for the 64 experts of a 16-expert, top-4 demo:
    every decode step evicts, so fills land in slots that earlier layers and steps read, and the prefill streams
    whole layers (no fills), fills on demand (evicting its own earlier layers' experts) or is chosen by the cost
    model. Batch 1 and 4 (graph sizes 1 and 4), each run twice: as is, and with the copy stream delayed at random
    (sleep kernels queued on it from another thread, so fills land late in random layers and every read of a filled
    slot must wait for its fill). The tokens equal fused's, and after every step each expert the planner counts
    resident is in its slot. (On the H200 at 02:51 the 32-slot case parted from fused once, at step 3, and in none
    of the later runs, with or without the delays.)"""
    path, fused = eviction_demo
    prompts = EVICTION_PROMPTS[:num_prompts]
    cfg = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        kv_cache_gb=0.5,
        max_num_seqs=4,
        moe_backend="offload",
        expert_slots=slots,
        prefill_strategy=prefill,
    )
    delays = _copy_stream_delays()
    for delayed in (False, True):
        engine = LLMEngine.from_dir(path, cfg)
        assert isinstance(engine.runner.decode, DrivenGraphRunner) and engine.runner.decode.captured

        def resident_in_slots(step: int, engine: LLMEngine = engine, delayed: bool = delayed) -> None:
            assert engine.experts.stale_slots() == [], f"step {step}, delayed copies: {delayed}"

        with delays(engine.experts.copy_stream, seed=slots + num_prompts) if delayed else contextlib.nullcontext():
            tokens = greedy_tokens(engine, prompts, 16, resident_in_slots)
        assert tokens == fused[num_prompts], f"delayed copies: {delayed}"
        assert sum(engine.experts.stats()["layers"]["evictions"]) > 0


def _chosen_logprobs(engine: LLMEngine, prompts, max_tokens: int) -> list[list[tuple[int, float, list[float]]]]:
    """Greedy tokens of each prompt as (token, its log-probability, the top-2 log-probabilities)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[tuple[int, float, list[float]]]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend((lp.token_id, lp.logprob, [v for _, v in lp.top]) for lp in o.chunk.logprobs)
    return [out[str(i)] for i in range(len(prompts))]


def _close(a: float, b: float) -> bool:
    """Log-probabilities equal to bf16 rounding of the logits."""
    return abs(a - b) <= 0.05 + 0.02 * abs(b)


@pytest.mark.parametrize("mode,slots", [("hybrid", 9), ("cpu", 0), ("offload", 5)])
def test_driven_host_experts_follow_fused(tmp_path, mode, slots):
    """bfloat16 on CUDA: hybrid, cpu and offload with 5 slots (fewer than one token's 8 experts, so picks run on the
    CPU too) decode through the driver thread's CPU experts (bf16 inputs, float32 sums) and follow fused: the chosen
    tokens' log-probabilities agree to bf16 rounding until the first token that differs, and there fused's top two
    tokens were a near-tie (equal to that rounding), which the other rounding may flip."""
    from freetoken._core import ExpertPool
    from freetoken.models.loader import load_checkpoint
    from freetoken.moe.expert_cache import ExpertCacheBackend
    from freetoken.moe.fused import FusedExperts

    path = build_demo_checkpoint(tmp_path / "demo", seed=9)
    device = torch.device("cuda")
    cfg = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_gb=0.5)
    model = load_checkpoint(path, FusedExperts(), device, torch.bfloat16)
    want = _chosen_logprobs(LLMEngine(model, model.config, cfg, tokenizer=None), PROMPTS, 12)
    backend = ExpertCacheBackend(
        mode,
        ExpertPool.from_checkpoint(path),
        device,
        slots,
        cpu_threads=4,
        pcie_bytes_per_s=50e9,
        cpu_bytes_per_s={1: 20e9, 4: 40e9},
    )
    model.attach_experts(backend)
    engine = LLMEngine(model, model.config, cfg, tokenizer=None)
    assert isinstance(engine.runner.decode, DrivenGraphRunner) and engine.runner.decode.captured
    got = _chosen_logprobs(engine, PROMPTS, 12)
    for g, w in zip(got, want, strict=False):
        for step, ((tg, lg, _), (tw, lw, top)) in enumerate(zip(g, w, strict=False)):
            if tg != tw:
                assert _close(top[1], top[0]), f"step {step}: {tg} instead of {tw}, fused's top-2 {top} not a tie"
                break
            assert _close(lg, lw), (step, lg, lw)
    stats = backend.stats()["layers"]
    assert sum(stats["cpu_runs"]) > 0
    if mode == "hybrid":
        assert sum(stats["fills"]) > 0


@pytest.mark.parametrize("backend", ["fused", "offload"])
def test_constrained_decoding_on_cuda_graph_path(tmp_path, backend):
    """response_format's grammar mask on CUDA logits, through the captured decode step (whole-step graphs for
    fused, the driven graphs for offload): constrained rows of a random model give schema-valid JSON and end with EOS
    (sampled and greedy), beside an unconstrained row in the same batch."""
    import json

    import jsonschema

    from freetoken.engine.structured import json_grammar
    from schemas import CARD_SCHEMA

    path = build_demo_checkpoint(tmp_path / "demo", seed=8)
    engine = LLMEngine.from_dir(
        path, EngineConfig(device="cuda", dtype="bfloat16", kv_cache_gb=0.5, moe_backend=backend, expert_slots=16)
    )
    assert engine.runner.decode is not None
    grammar = json_grammar(CARD_SCHEMA)
    batch = {
        "sampled": SamplingParams(max_tokens=400, temperature=1.0, seed=3, grammar=engine.grammars.matcher(grammar)),
        "greedy": SamplingParams(max_tokens=400, temperature=0.0, grammar=engine.grammars.matcher(grammar)),
        "free": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    }
    for name, params in batch.items():
        engine.add_request(name, PROMPTS[0], params)
    out: dict[str, list[int]] = {name: [] for name in batch}
    finish: dict[str, str | None] = {}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.chunk.token_ids)
            if o.chunk.finish_reason is not None:
                finish[o.request_id] = o.chunk.finish_reason
    for name in ("sampled", "greedy"):
        assert finish[name] == "stop", (name, finish[name])
        text = engine.tokenizer.decode([t for t in out[name] if t not in engine.eos_ids])
        jsonschema.validate(json.loads(text), CARD_SCHEMA)
    assert len(out["free"]) == 24


def test_fused_layer_ops_are_bitwise_the_torch_ops():
    """bf16 on the GPU: the fused add + RMSNorm and q/k norm + RoPE + KV-write kernels give exactly what the ops
    they replace give (torch's add, RoPE and index_put around the RMSNorm kernel), so no backend's tokens move."""
    from freetoken.kernels.layer_ops import add_rms_norm, qk_norm_rope, rms_norm
    from freetoken.models.qwen3_moe import RotaryEmbedding, _apply_rope

    gen = torch.Generator(device="cuda").manual_seed(5)
    bf16 = torch.bfloat16
    tokens, nq, nkv, d, hidden = 7, 32, 4, 128, 2048
    x, residual = ((3 * torch.randn(tokens, hidden, device="cuda", generator=gen)).to(bf16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(bf16)
    got, got_sum = add_rms_norm(x, residual, w, 1e-6)
    want_sum = residual + x
    assert torch.equal(got_sum, want_sum) and torch.equal(got, rms_norm(want_sum, w, 1e-6))

    qkv = (3 * torch.randn(tokens, (nq + 2 * nkv) * d, device="cuda", generator=gen)).to(bf16)
    q_w, k_w = ((1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(bf16) for _ in range(2))
    positions = torch.randint(0, 30000, (tokens,), device="cuda", generator=gen)
    cos, sin = RotaryEmbedding(d, 1e6).to("cuda")(positions, bf16)
    slots = torch.randperm(4 * tokens, device="cuda", generator=gen)[:tokens]
    k_cache, v_cache = (torch.zeros(4 * tokens, nkv, d, dtype=bf16, device="cuda") for _ in range(2))
    q = qk_norm_rope(qkv, nq, nkv, q_w, k_w, 1e-6, cos, sin, k_cache, v_cache, slots)
    q_in, k_in, v_in = qkv.split([nq * d, nkv * d, nkv * d], dim=1)
    want_q = _apply_rope(rms_norm(q_in.view(tokens, nq, d), q_w, 1e-6), cos, sin)
    want_k = _apply_rope(rms_norm(k_in.view(tokens, nkv, d), k_w, 1e-6), cos, sin)
    assert torch.equal(q, want_q)
    assert torch.equal(k_cache[slots], want_k) and torch.equal(v_cache[slots], v_in.view(tokens, nkv, d))
