"""The activation formula against the CUDA allocator's peak: one step of the real Qwen3-30B-A3B and Qwen3.5-35B-A3B
layer shapes (4 layers, dummy weights, the Triton kernels, flash attention) at the largest chunk, after a warm-up.

    python -m pytest tests/models/test_activations_gpu.py -m gpu -q -s
"""

from __future__ import annotations

import json

import pytest
import torch

from activation_peak import measure_prefill_peak
from freetoken.config import ModelConfig
from freetoken.models.activations import step_activation_nbytes
from freetoken.models.presets import preset_config_path


def four_layers(name: str) -> ModelConfig:
    raw = json.loads(preset_config_path(name).read_text())
    text = raw.get("text_config", raw)
    text["num_hidden_layers"] = 4
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:4]
    return ModelConfig.from_dict(raw, source="preset")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model,query_lens,context_lens",
    [
        ("qwen3-30b-a3b", [32768], [32768]),
        ("qwen3-30b-a3b", [8192], [40960]),
        ("qwen3-30b-a3b", [32753] + [1] * 15, [32768] + [40960] * 15),
        ("qwen3.5-35b-a3b", [32768], [32768]),
        ("qwen3.5-35b-a3b", [8177] + [1] * 15, [8192] + [30000] * 15),
    ],
)
def test_cuda_peak_within_the_formula(model, query_lens, context_lens):
    cfg = four_layers(model)
    parts = step_activation_nbytes(cfg, sum(query_lens), max(context_lens), len(query_lens), torch.bfloat16)
    measure_prefill_peak(cfg, query_lens, context_lens, "cuda")  # warm-up: Triton compiles, cuBLAS workspaces
    peak = measure_prefill_peak(cfg, query_lens, context_lens, "cuda").nbytes
    free, total = torch.cuda.mem_get_info()
    print(
        f"\n{model} {len(query_lens)} seqs: peak {peak / 1e9:.3f} GB, formula {max(parts.values()) / 1e9:.3f} GB "
        f"({max(parts, key=parts.__getitem__)}); allocator reserved-allocated "
        f"{(torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 1e9:.3f} GB, outside torch "
        f"{(total - free - torch.cuda.memory_reserved()) / 1e9:.3f} GB"
    )
    assert peak <= max(parts.values()), parts
