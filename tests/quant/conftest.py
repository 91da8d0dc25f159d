"""Fixtures of the quantized-format tests: small checkpoints in the real layouts, with their dequantized twins."""

from __future__ import annotations

import pytest

from freetoken.quant import NVFP4, fp8_block


@pytest.fixture(
    scope="module",
    params=[("fp8", "per_expert"), ("fp8", "fused"), ("nvfp4", "per_expert")],
    ids="-".join,
)
def built(request, tmp_path_factory, checkpoint_overrides):
    """(quantized checkpoint, float32 checkpoint of its dequantized weights, format), for FP8 with 32 x 32 blocks
    (the demo's sizes, H 64 and I 32, in whole blocks) per expert and fused 3-D, and NVFP4. Each module says the
    seed and config overrides by its own `checkpoint_overrides` fixture: (seed, {config key: value})."""
    from freetoken.quant.checkpoint import build_quantized_checkpoint  # after freetoken.engine (the loader's order)

    name, layout = request.param
    fmt = fp8_block(32, 32) if name == "fp8" else NVFP4
    seed, overrides = checkpoint_overrides
    root = tmp_path_factory.mktemp(f"{name}-{layout}")
    q = build_quantized_checkpoint(
        root / "q", fmt, seed=seed, expert_layout=layout, dequantized_dest=root / "deq", **overrides
    )
    return q, root / "deq", fmt
