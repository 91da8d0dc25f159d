"""On a CUDA device: the same engine gives the CPU's greedy tokens, and bfloat16 follows transformers.

Skipped without a GPU (CI); run on the GPU box with `python -m pytest tests/test_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import build_demo_checkpoint

from reference import make_reference_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[3, 17, 100, 42, 7, 8, 9, 200, 13], [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


def _greedy(path, device: str, dtype: str, prompts, max_tokens: int) -> list[list[int]]:
    engine = LLMEngine.from_dir(path, EngineConfig(device=device, dtype=dtype, kv_cache_gb=0.5))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.chunk.token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def test_demo_greedy_on_cuda_equals_cpu(tmp_path):
    path = build_demo_checkpoint(tmp_path / "demo", seed=3)
    assert _greedy(path, "cuda", "float32", PROMPTS, 32) == _greedy(path, "cpu", "float32", PROMPTS, 32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bfloat16_greedy_follows_transformers(tmp_path, seed):
    ref = make_reference_checkpoint(tmp_path / "ref", seed=seed, lm_head_std=0.6).to("cuda", torch.bfloat16)
    got = _greedy(tmp_path / "ref", "cuda", "bfloat16", PROMPTS, 16)
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            expected = ref.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, len(prompt):].tolist()
        assert tokens == expected
