"""The demo Qwen3-MoE checkpoint loads in transformers 5 exactly as a real one would.

Run: python -m pytest tests/models/test_demo.py -q
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from freetoken.models import demo
from freetoken.models.presets import preset_config_path

transformers = pytest.importorskip("transformers")

REAL_CONFIG = preset_config_path("qwen3-30b-a3b")  # byte-exact copy of shared/models/qwen3-30b-a3b/config.json


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One freetoken cache for the whole test session (the tokenizer conversion runs once)."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.getbasetemp() / "freetoken-cache"
        mp.setenv("FREETOKEN_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def demo_dir(cache_dir):
    return demo.demo_checkpoint_dir()


def load_hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    return model.eval()


def logits(model, ids=(9707, 11, 220, 108386, 1879, 151645)):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def tensor_names(path: Path) -> dict[str, tuple[int, ...]]:
    names = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return names


def test_demo_dir_is_built_once_and_complete(demo_dir, cache_dir):
    assert demo_dir == cache_dir / "models" / demo.DEMO_NAME
    files = {p.name for p in demo_dir.iterdir()}
    assert files == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    mtime = (demo_dir / "model.safetensors").stat().st_mtime_ns
    assert demo.demo_checkpoint_dir() == demo_dir
    assert (demo_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in demo_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_config_keeps_the_real_keys(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    assert set(config) == set(json.loads(REAL_CONFIG.read_text()))
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["vocab_size"] == 151936 and config["torch_dtype"] == "float32"
    with pytest.raises(ValueError, match="unknown Qwen3-MoE config keys"):
        demo.demo_config(num_routed_experts=4)


def test_tensor_names_and_shapes(demo_dir):
    names = tensor_names(demo_dir)
    H, I, E, V = 64, 32, 8, 151936
    assert names["model.embed_tokens.weight"] == (V, H)
    assert names["lm_head.weight"] == (V, H)
    assert names["model.layers.3.mlp.gate.weight"] == (E, H)
    assert names["model.layers.0.mlp.experts.7.gate_proj.weight"] == (I, H)
    assert names["model.layers.0.mlp.experts.7.down_proj.weight"] == (H, I)
    assert names["model.layers.0.self_attn.q_proj.weight"] == (4 * 16, H)
    assert names["model.layers.0.self_attn.k_proj.weight"] == (2 * 16, H)
    assert names["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert len(names) == 2 + 1 + 4 * (8 + 1 + 3 * E)


def test_transformers_loads_it_with_no_missing_or_unexpected_keys(demo_dir):
    out = logits(load_hf(demo_dir))
    assert torch.isfinite(out).all()
    assert 0.05 < out.std() < 2.0  # well-conditioned: neither flat nor saturated


def test_same_seed_same_weights_other_seed_differs(tmp_path, cache_dir):
    a = demo.build_demo_checkpoint(tmp_path / "a", seed=3, num_hidden_layers=1)
    b = demo.build_demo_checkpoint(tmp_path / "b", seed=3, num_hidden_layers=1)
    c = demo.build_demo_checkpoint(tmp_path / "c", seed=4, num_hidden_layers=1)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"mlp_only_layers": [1]},
        {"decoder_sparse_step": 2},
    ],
)
def test_config_variants_load(tmp_path, cache_dir, overrides):
    path = demo.build_demo_checkpoint(tmp_path, seed=1, **overrides)
    names = tensor_names(path)
    if overrides.get("tie_word_embeddings"):
        assert "lm_head.weight" not in names
    dense = {1} if "mlp_only_layers" in overrides else {0, 2} if "decoder_sparse_step" in overrides else set()
    for layer in range(4):
        assert (f"model.layers.{layer}.mlp.gate_proj.weight" in names) == (layer in dense)
        assert (f"model.layers.{layer}.mlp.gate.weight" in names) == (layer not in dense)
    assert names.get("model.layers.1.mlp.down_proj.weight", (64, 128)) == (64, 128)
    load_hf(path)


def test_fused_layout_is_the_same_model(tmp_path, cache_dir):
    per_expert = demo.build_demo_checkpoint(tmp_path / "per_expert", seed=2)
    fused = demo.build_demo_checkpoint(tmp_path / "fused", seed=2, expert_layout="fused")
    names = tensor_names(fused)
    assert names["model.layers.0.mlp.experts.gate_up_proj"] == (8, 2 * 32, 64)
    assert names["model.layers.0.mlp.experts.down_proj"] == (8, 64, 32)
    with safe_open(per_expert / "model.safetensors", "pt") as p, safe_open(fused / "model.safetensors", "pt") as f:
        gate_up = f.get_tensor("model.layers.2.mlp.experts.gate_up_proj")
        assert torch.equal(gate_up[5, :32], p.get_tensor("model.layers.2.mlp.experts.5.gate_proj.weight"))
        assert torch.equal(gate_up[5, 32:], p.get_tensor("model.layers.2.mlp.experts.5.up_proj.weight"))
    torch.testing.assert_close(logits(load_hf(fused)), logits(load_hf(per_expert)), rtol=0, atol=1e-5)


def test_sharded_checkpoint(tmp_path, cache_dir):
    single = demo.build_demo_checkpoint(tmp_path / "single", seed=5)
    sharded = demo.build_demo_checkpoint(tmp_path / "sharded", seed=5, num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert set(index["weight_map"].values()) == set(shards)
    assert index["weight_map"].keys() == tensor_names(single).keys()
    for name, shard in index["weight_map"].items():
        with safe_open(sharded / shard, "pt") as f:
            assert name in f.keys()
    assert index["metadata"]["total_size"] == sum(4 * torch.Size(s).numel() for s in tensor_names(single).values())
    torch.testing.assert_close(logits(load_hf(sharded)), logits(load_hf(single)), rtol=0, atol=0)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="expert_layout"):
        demo.build_demo_checkpoint(tmp_path, expert_layout="stacked")
    with pytest.raises(ValueError, match="num_shards"):
        demo.build_demo_checkpoint(tmp_path, num_shards=0)
