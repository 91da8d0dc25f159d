"""Diagnostic for issue 22 (tests/models/test_qwen3_5_gpu.py::test_expert_cache_decode_with_the_hybrid): the offload
backend's driven decode parts from fused when its slots hold half the pool (the first run of this script, at
02:51: every Qwen3.5 path matched fused that time, but Qwen3-MoE with 32 slots of 64 experts did not, where with
64 slots it did), so the fault is the driven step's under evictions, not the hybrid's. Per configuration: tokens
equal to fused or not, the first step that differs, and the largest
log-probability difference of the chosen tokens before it (bf16, CUDA).

    PYTHONPATH=$PWD/python python benches/diag_hybrid_offload.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from freetoken.config import EngineConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import build_demo_checkpoint
from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint

PROMPTS = [[3, 17, 100, 42, 7, 8, 9, 200, 13], [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 5]
STEPS = 16


def run(path: Path, **engine_args) -> list[list[tuple[int, float]]]:
    """(token, log-probability) of each greedy step per prompt."""
    engine_args.setdefault("moe_backend", "fused")
    engine = LLMEngine.from_dir(path, EngineConfig(device="cuda", dtype="bfloat16", kv_cache_gb=0.5, **engine_args))
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend((lp.token_id, lp.logprob) for lp in o.chunk.logprobs)
    runner = engine.runner.decode
    kind = "eager" if runner is None or not runner.captured else runner.kind
    stats = engine.experts.stats().get("layers", {}) if hasattr(engine.experts, "stats") else {}
    print(f"    decode: {kind}; fills per layer {stats.get('fills')}", file=sys.stderr)
    return [out[str(i)] for i in range(len(PROMPTS))]


def compare(label: str, got, want) -> None:
    parts = []
    for g, w in zip(got, want, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a[0] != b[0]), None)
        upto = len(g) if first is None else first
        drift = max((abs(a[1] - b[1]) for a, b in zip(g[:upto], w[:upto], strict=True)), default=0.0)
        parts.append(f"{'equal' if first is None else f'differs at step {first}'} (max |dlogprob| before: {drift:.4f})")
    print(f"{label}: " + "; ".join(parts), flush=True)


def main() -> None:
    """Qwen3-MoE's demo with 16 experts a layer and 32 slots (half the pool) parts from fused under the driven
    graphs (first run, 02:51); here: is it every run, and does it stay when the hits' tiles wait for the layer's
    fills (so no slot kernel runs while a fill lands) or when the driven step runs eagerly (no graph)?"""
    from freetoken.engine import cuda_graph
    from freetoken.moe import expert_cache

    tmp = Path(tempfile.mkdtemp())
    q3 = build_demo_checkpoint(tmp / "q3", seed=6, num_experts=16, num_experts_per_tok=4)
    fused3 = run(q3)
    for repeat in range(2):
        compare(
            f"qwen3-moe offload 32 slots, driven graphs (run {repeat})",
            run(q3, moe_backend="offload", expert_slots=32),
            fused3,
        )
    saved_slots = expert_cache.ExpertCacheBackend.run_slots

    def serial_slots(self, hidden, weights, pairs, tiles, out, before_stage=None):
        if before_stage is not None:
            before_stage(0)  # the fill flag: every fill of the layer has landed before the hits' tiles run
        return saved_slots(self, hidden, weights, pairs, tiles, out, before_stage)

    expert_cache.ExpertCacheBackend.run_slots = serial_slots
    try:
        compare(
            "qwen3-moe offload 32 slots, driven graphs, hits after the fills",
            run(q3, moe_backend="offload", expert_slots=32),
            fused3,
        )
    finally:
        expert_cache.ExpertCacheBackend.run_slots = saved_slots
    driven = cuda_graph.DrivenGraphRunner
    saved_step, saved_capture = driven._step, driven._capture

    def eager_capture(self):
        self._pad_from(0)

    def eager_driven(self, size, batch):
        self.handshake.start(batch, size)
        try:
            for part in self.parts:
                self._forward_driven(size, part)
        finally:
            self._finish()
        return self.logits[:batch]

    driven._step, driven._capture = eager_driven, eager_capture
    try:
        compare(
            "qwen3-moe offload 32 slots, driven step run eagerly (no graph)",
            run(q3, moe_backend="offload", expert_slots=32),
            fused3,
        )
    finally:
        driven._step, driven._capture = saved_step, saved_capture
    q35 = build_qwen3_5_demo_checkpoint(tmp / "q35", seed=6, num_experts=16, num_experts_per_tok=4)
    fused = run(q35)
    for repeat in range(2):
        compare(
            f"qwen3.5 offload 32 slots, driven graphs (run {repeat})",
            run(q35, moe_backend="offload", expert_slots=32),
            fused,
        )


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
