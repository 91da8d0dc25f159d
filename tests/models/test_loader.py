"""Checkpoint loading: every broken checkpoint gives an error naming the file and/or tensor and what is wrong;
sharded and single-file checkpoints load the same model; `--dummy-weights` builds a full model from config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from freetoken.config import ConfigError, EngineConfig, ModelConfig
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.attention import AttentionMetadata
from freetoken.models.demo import build_demo_checkpoint
from freetoken.models.loader import CheckpointError, init_dummy_weights, load_checkpoint
from freetoken.moe import FusedExperts

CPU = torch.device("cpu")
PROMPT = [1707, 11, 847, 829, 374, 1149, 323]
# Small enough to write quickly: the vocabulary is shrunk too (token ids stay below 2000).
SMALL = {"vocab_size": 2048, "num_hidden_layers": 3, "mlp_only_layers": [1]}


def _load(path: Path):
    return load_checkpoint(path, FusedExperts(), CPU, torch.float32)


def _logits(model, prompt=PROMPT) -> torch.Tensor:
    n = len(prompt)
    kv = KVCache(len(model.model.layers), _kv_heads(model), _head_dim(model), 8, 16, torch.float32, CPU)
    meta = AttentionMetadata.build([n], [n], [list(range(kv.blocks_for(n)))], kv.block_size, CPU)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(prompt), meta, kv.layers))


def _kv_heads(model) -> int:
    attn = model.model.layers[0].self_attn
    return attn.k_proj.weight.shape[0] // attn.k_norm.weight.shape[0]


def _head_dim(model) -> int:
    return model.model.layers[0].self_attn.k_norm.weight.shape[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A small demo checkpoint, one file, one tensor per expert, a dense layer among MoE ones."""
    return build_demo_checkpoint(tmp_path_factory.mktemp("small"), seed=3, **SMALL)


@pytest.fixture(scope="module")
def small_logits(small) -> torch.Tensor:
    return _logits(_load(small))


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, dirs_exist_ok=True)
    return dest


def _rewrite(path: Path, edit) -> None:
    """Load model.safetensors, let `edit(tensors)` change the dict, save it back."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _config(path: Path, **changes) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        raw.pop(key)
    (path / "config.json").write_text(json.dumps(raw))


EXPERT = "model.layers.0.mlp.experts.5.up_proj.weight"
ATTN = "model.layers.2.self_attn.k_proj.weight"


def test_loads_and_is_not_degenerate(small_logits):
    assert torch.isfinite(small_logits).all()
    assert small_logits.std() > 0


@pytest.mark.parametrize("num_shards", [2, 3])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_sharded_and_fused_load_the_same(tmp_path, small_logits, num_shards, layout):
    path = build_demo_checkpoint(tmp_path, seed=3, num_shards=num_shards, expert_layout=layout, **SMALL)
    assert not (path / "model.safetensors").exists()
    assert len(list(path.glob("model-*-of-*.safetensors"))) == num_shards
    assert torch.equal(_logits(_load(path)), small_logits)


def test_missing_shard(tmp_path):
    path = build_demo_checkpoint(tmp_path, seed=3, num_shards=3, **SMALL)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00003\.safetensors.*missing") as e:
        _load(path)
    assert "index" in str(e.value)


def test_index_lists_tensor_absent_from_its_shard(tmp_path):
    path = build_demo_checkpoint(tmp_path, seed=3, num_shards=2, **SMALL)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.self_attn.q_proj.weight"] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"model-00001-of-00002\.safetensors.*layers\.9\.self_attn\.q_proj.*index"
    ):
        _load(path)


def test_corrupt_index(tmp_path):
    path = build_demo_checkpoint(tmp_path, seed=3, num_shards=2, **SMALL)
    (path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        _load(path)


def test_corrupt_safetensors_file(tmp_path, small):
    path = _copy(small, tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        _load(path)


@pytest.mark.parametrize(
    "name",
    [
        ATTN,
        EXPERT,
        "model.norm.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.2.mlp.gate.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor(tmp_path, small, name):
    path = _copy(small, tmp_path / "m")
    _rewrite(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        _load(path)
    assert "missing" in str(e.value)


def test_wrong_shape(tmp_path, small):
    path = _copy(small, tmp_path / "m")
    _rewrite(path, lambda t: t.update({ATTN: t[ATTN][:-1]}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{ATTN}.*shape \[31, 64\].*\[32, 64\]"):
        _load(path)


def test_wrong_shape_expert(tmp_path, small):
    path = _copy(small, tmp_path / "m")
    _rewrite(path, lambda t: t.update({EXPERT: t[EXPERT].T.contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{EXPERT}.*shape"):
        _load(path)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_integer_dtype(tmp_path, small, dtype):
    path = _copy(small, tmp_path / "m")
    _rewrite(path, lambda t: t.update({ATTN: torch.ones_like(t[ATTN], dtype=dtype)}))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors.*{ATTN}.*dtype"):
        _load(path)


def test_integer_dtype_fused_experts(tmp_path):
    path = build_demo_checkpoint(tmp_path, seed=3, expert_layout="fused", **SMALL)
    name = "model.layers.2.mlp.experts.down_proj"
    _rewrite(path, lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(CheckpointError, match=rf"{name}.*dtype"):
        _load(path)


def test_half_precision_checkpoint_loads(tmp_path, small, small_logits):
    path = _copy(small, tmp_path / "m")
    _rewrite(path, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    got = _logits(_load(path))
    assert torch.isfinite(got).all() and (got - small_logits).abs().max() < 0.05


def test_unsupported_architecture(tmp_path, small):
    path = _copy(small, tmp_path / "m")
    _config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match=r"config\.json.*LlamaForCausalLM.*not supported"):
        _load(path)
    _config(path, architectures=None)
    with pytest.raises(ConfigError, match=r"config\.json.*not supported"):
        _load(path)


def test_missing_config(tmp_path, small):
    path = _copy(small, tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        _load(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{oops", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"architectures": ["Qwen3MoeForCausalLM"]}', "missing required key"),
    ],
)
def test_bad_config(tmp_path, small, text, message):
    path = _copy(small, tmp_path / "m")
    (path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        _load(path)
    assert "config.json" in str(e.value)


def test_bad_config_value(tmp_path, small):
    path = _copy(small, tmp_path / "m")
    _config(path, hidden_size="big")
    with pytest.raises(ConfigError, match=r"config\.json.*hidden_size"):
        _load(path)
    _config(path, hidden_size=64, num_key_value_heads=0)
    with pytest.raises(ConfigError, match=r"config\.json.*num_key_value_heads"):
        _load(path)


def test_no_safetensors_suggests_dummy_weights(tmp_path, small):
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(small / "config.json", path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"--dummy-weights") as e:
        _load(path)
    assert str(path) in str(e.value)


def test_tied_embeddings_without_lm_head(tmp_path):
    path = build_demo_checkpoint(tmp_path, seed=3, tie_word_embeddings=True, **SMALL)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = _load(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert torch.equal(model.lm_head.weight, f.get_tensor("model.embed_tokens.weight"))
    assert torch.isfinite(_logits(model)).all()


def test_untied_without_lm_head_is_an_error(tmp_path, small):
    path = _copy(small, tmp_path / "m")
    _rewrite(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*missing.*tie_word_embeddings"):
        _load(path)


def test_untied_config_with_tied_checkpoint_named_as_such(tmp_path):
    """A tied checkpoint served with tie_word_embeddings=false must not load (lm_head would be garbage)."""
    path = build_demo_checkpoint(tmp_path, seed=3, tie_word_embeddings=True, **SMALL)
    _config(path, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        _load(path)


# --- dummy weights ----------------------------------------------------------------------------------------------------


def _dummy(cfg: ModelConfig, seed: int, dtype=torch.float32):
    experts = FusedExperts()
    return init_dummy_weights(cfg, experts, CPU, dtype, seed=seed), experts


@pytest.mark.parametrize(
    "overrides", [{}, {"tie_word_embeddings": True}, {"decoder_sparse_step": 2}, {"attention_bias": True}]
)
def test_dummy_weights_complete_and_deterministic(overrides):
    from freetoken.models.demo import demo_config

    cfg = ModelConfig.from_dict(demo_config(**{**SMALL, **overrides}))
    model, experts = _dummy(cfg, seed=11)
    tensors = dict(model.named_parameters())
    tensors.update({f"experts.{layer}.gate_up": t for layer, t in experts.gate_up.items()})
    tensors.update({f"experts.{layer}.down": t for layer, t in experts.down.items()})
    tensors.update({f"buffer.{n}": b for n, b in model.named_buffers()})
    assert sorted(experts.gate_up) == cfg.moe_layers
    for name, t in tensors.items():
        assert torch.isfinite(t).all(), name
        assert t.abs().max() > 0, f"{name} is all zero"
        assert t.abs().max() < 1e3, f"{name} holds garbage"
        if t.numel() > 16 and not name.endswith("norm.weight"):
            assert t.std() > 0, f"{name} is constant"
    again, again_experts = _dummy(cfg, seed=11)
    for name, t in again.named_parameters():
        assert torch.equal(t, tensors[name]), name
    for layer in cfg.moe_layers:
        assert torch.equal(again_experts.gate_up[layer], experts.gate_up[layer])
    other, _ = _dummy(cfg, seed=12)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.isfinite(_logits(model)).all()
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_dummy_weights_read_no_files(tmp_path, small):
    """`--dummy-weights` needs config.json only; the engine runs and is deterministic in --seed."""
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(small / "config.json", path / "config.json")

    def tokens(seed):
        cfg = EngineConfig(device="cpu", dtype="float32", dummy_weights=True, seed=seed, max_model_len=64)
        engine = LLMEngine.from_dir(path, cfg)
        assert engine.tokenizer is None
        engine.add_request("x", PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        out = []
        while engine.has_work():
            out += [t for o in engine.step() for t in o.chunk.token_ids]
        return out

    a = tokens(0)
    assert len(a) == 6 and a == tokens(0)
    assert a != tokens(1)


def test_dummy_weights_bfloat16():
    from freetoken.models.demo import demo_config

    cfg = ModelConfig.from_dict(demo_config(**SMALL))
    model, experts = _dummy(cfg, seed=0, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(t.dtype == torch.bfloat16 for t in experts.gate_up.values())
