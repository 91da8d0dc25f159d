"""Quantized expert formats: the format table and config parsing, the reference codecs against torch's own float8
types and the published definitions, small checkpoints in the real layouts, and a CPU model with quantized experts
against the float model built from the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_loader import _logits

import freetoken.engine  # noqa: F401  (before freetoken.models.loader, which imports only after the engine)
from freetoken.config import ModelConfig
from freetoken.models.loader import (
    CheckpointError,
    CheckpointReader,
    TensorIndex,
    load_checkpoint,
    text_prefix,
)
from freetoken.moe import FusedExperts
from freetoken.quant import BF16, MXFP4, NVFP4, QuantConfigError, fp8_block, quant_spec
from freetoken.quant import reference as ref
from freetoken.quant.checkpoint import build_quantized_checkpoint, read_experts
from freetoken.quant.formats import QuantSpec

# A byte-exact copy of shared/models/qwen3.5-122b-a10b-fp8/config.json (Qwen/Qwen3.5-122B-A10B-FP8).
REAL_FP8_CONFIG = Path(__file__).parents[1] / "data/configs/qwen3.5-122b-a10b-fp8.json"
# A byte-exact copy of shared/models/gpt-oss-20b/config.json (openai/gpt-oss-20b), the released MXFP4 config.
REAL_MXFP4_CONFIG = Path(__file__).parents[1] / "data/configs/gpt-oss-20b.json"
SMALL = {"vocab_size": 2048, "num_hidden_layers": 3, "mlp_only_layers": [1]}
FP8_SMALL = fp8_block(32, 32)  # the demo's sizes (H 64, I 32) in whole blocks
ALL_CODES = torch.arange(256, dtype=torch.uint8)


# --- codecs -------------------------------------------------------------------------------------------------------


def test_e4m3_decoder_matches_torch_for_every_code():
    ours, torchs = (
        ref.decode_e4m3(ALL_CODES),
        ALL_CODES.view(torch.float8_e4m3fn).float(),
    )
    assert torch.equal(ours.isnan(), torchs.isnan()) and int(ours.isnan().sum()) == 2  # S.1111.111 only
    assert torch.equal(ours.nan_to_num(0), torchs.nan_to_num(0))
    assert ours.nan_to_num(0).max() == 448.0 and ours[1] == 2.0**-9  # largest normal, smallest subnormal


def test_e8m0_decoder_matches_torch_for_every_code():
    ours, torchs = (
        ref.decode_e8m0(ALL_CODES),
        ALL_CODES.view(torch.float8_e8m0fnu).float(),
    )
    assert torch.equal(ours.nan_to_num(0), torchs.nan_to_num(0)) and ours[127] == 1.0 and ours[255].isnan()


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -5.1, 0.1, -0.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0, 0.0, -0.0])
    assert torch.equal(ref.decode_e2m1(ref.encode_e2m1(x)), want)
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(ref.encode_e2m1(ref.decode_e2m1(codes))[:8], codes[:8])  # every value is its own code
    assert torch.equal(ref.unpack_nibbles(ref.pack_nibbles(codes)), codes)
    assert ref.pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # element 0 in the low nibble


@pytest.mark.parametrize(
    "fmt",
    [fp8_block(), fp8_block(32, 64), NVFP4, MXFP4],
    ids=lambda f: f"{f.name}{f.block_rows}",
)
def test_quantizers_are_close_and_idempotent(fmt):
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 0.02
    parts = ref.quantize_matrix(fmt, w)
    deq = ref.dequantize_matrix(fmt, parts["weight"], parts["scale"], parts.get("tensor_scale"))
    bound = {"fp8_block": 0.04, "nvfp4": 0.12, "mxfp4": 0.15}[fmt.name]  # relative Frobenius error, 3 / 1 bits
    assert (deq - w).norm() / w.norm() < bound
    if fmt.tensor_scale:  # NVFP4's tensor scale comes from the amax, which dequantization moves: no fixed point
        return
    again = ref.quantize_matrix(fmt, deq)  # the dequantized weights are representable: the same bytes come back
    for key in parts:
        assert torch.equal(again[key].view(torch.uint8), parts[key].view(torch.uint8)), key


def test_fp8_block_partial_blocks_and_torch_cast():
    w = torch.randn(200, 130, generator=torch.Generator().manual_seed(1))
    q, s = ref.quantize_fp8_block(w)
    assert q.shape == (200, 130) and s.shape == (2, 2)
    # The formula decoder and torch's float8 cast agree on the product, block by block.
    deq = ref.dequantize_fp8_block(q, s)
    torchs = q.float() * s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :130]
    assert torch.equal(deq, torchs)


# --- formats and configs ------------------------------------------------------------------------------------------


def test_layout_of_real_shapes():
    h, i = 2048, 768  # Qwen3-30B-A3B
    assert BF16.layout(h, i).expert_nbytes == 3 * h * i * 2
    fp8 = fp8_block().layout(h, i)
    assert fp8.sections["gate_up_scale"] == (3 * h * i, 2 * 6 * 16 * 4)
    assert fp8.expert_nbytes == 3 * h * i + 64 * 4 * (2 * 6 * 16 + 16 * 6) // 64
    nv = NVFP4.layout(h, i)
    assert nv.sections["down"] == (h * i, h * i // 2)
    assert nv.expert_nbytes == 3 * h * i // 2 + 3 * h * i // 16 + 12
    assert MXFP4.layout(h, i).expert_nbytes == 3 * h * i // 2 + 3 * h * i // 32
    for layout in (fp8, nv):
        assert all(offset % 64 == 0 for offset, _ in layout.sections.values())


def test_real_fp8_config():
    raw = json.loads(REAL_FP8_CONFIG.read_text())
    spec = quant_spec(raw)
    assert spec.format == fp8_block(128, 128)
    assert not spec.converts("model.language_model.layers.0.mlp.gate")
    assert not spec.converts("lm_head")
    assert spec.converts("model.language_model.layers.0.mlp.experts.3.gate_proj")
    assert spec.converts("model.language_model.layers.3.self_attn.q_proj")
    spec.format.check_shape(raw["text_config"]["hidden_size"], raw["text_config"]["moe_intermediate_size"])


def test_real_mxfp4_config():
    """gpt-oss's `quantization_config` names MXFP4, and its `modules_to_not_convert` globs keep every module under
    them unquantized (`model.layers.*.self_attn` covers each projection of each layer)."""
    spec = quant_spec(json.loads(REAL_MXFP4_CONFIG.read_text()))
    assert spec.format == MXFP4 and spec.not_converted[0] == "model.layers.*.self_attn"
    assert not spec.converts("model.layers.23.self_attn.q_proj") and not spec.converts("model.layers.0.self_attn")
    assert not spec.converts("model.layers.4.mlp.router") and not spec.converts("lm_head")
    assert spec.converts("model.layers.4.mlp.experts") and spec.converts("model.layers.4.mlp.experts.gate_up_proj")
    assert spec.converts("model.layers.4.self_attn_extra.q_proj")  # a glob covers dotted children, not any suffix


def test_modelopt_configs(tmp_path):
    spec = quant_spec(
        {
            "quantization_config": {
                "quant_method": "modelopt",
                "quant_algo": "NVFP4",
                "ignore": ["lm_head", "*.mlp.gate"],
            }
        }
    )
    assert (
        spec.format == NVFP4
        and not spec.converts("model.layers.2.mlp.gate")
        and spec.converts("model.layers.2.mlp.experts.1.up_proj")
    )
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt"},
                "quantization": {
                    "quant_algo": "NVFP4",
                    "group_size": 16,
                    "exclude_modules": ["lm_head"],
                },
            }
        )
    )
    spec = quant_spec({}, tmp_path)
    assert spec.format == NVFP4 and not spec.converts("lm_head") and "hf_quant_config" in spec.source
    assert quant_spec({}).format == BF16


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method='awq' is not supported"),
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic"},
            "weight_block_size=None",
        ),
        (
            {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "activation_scheme": "static",
            },
            "activation_scheme",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"},
            "e5m2",
        ),
        ({"quant_method": "fp8", "weight_block_size": "128x128"}, r"'128x128'; expected two positive integers"),
        ({"quant_method": "fp8", "weight_block_size": [128.0, 128.0]}, "expected two positive integers"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "expected two positive integers"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo='FP8'"),
        (
            {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32},
            "group_size=32",
        ),
        (
            {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": "lm_head",
            },
            "list of module",
        ),
        ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
        ({"quant_method": "mxfp8"}, "quant_method='mxfp8' is not supported"),
    ],
)
def test_unsupported_configs_are_refused(qc, message):
    with pytest.raises(QuantConfigError, match=message):
        quant_spec({"quantization_config": qc})


def test_block_must_divide_expert_sizes():
    with pytest.raises(
        QuantConfigError,
        match="moe_intermediate_size=96 is not a multiple of the fp8_block",
    ):
        fp8_block().check_shape(2048, 96)


# --- checkpoints --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_overrides():
    """The seed and config of this module's `built` checkpoints (tests/conftest.py)."""
    return 5, SMALL


def test_checkpoint_has_real_names_and_dtypes(built):
    q, _, fmt = built
    tensors = load_file(q / "model.safetensors")
    if fmt.name == "fp8_block":
        assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
        assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (
            2,
            2,
        )
        assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # modules_to_not_convert
    elif fmt.name == "nvfp4":
        assert tensors["model.layers.0.mlp.experts.1.down_proj.weight"].shape == (
            64,
            16,
        )
        assert tensors["model.layers.0.mlp.experts.1.down_proj.weight_scale"].dtype == torch.float8_e4m3fn
        assert tensors["model.layers.0.mlp.experts.1.down_proj.weight_scale_2"].shape == ()
    else:  # gpt-oss's MXFP4 layout: [E, rows, in / 32, 16] U8 blocks, [E, rows, in / 32] U8 e8m0 scales
        base = "model.layers.0.mlp.experts."
        assert tensors[base + "gate_up_proj_blocks"].shape == (8, 64, 2, 16)
        assert tensors[base + "gate_up_proj_scales"].shape == (8, 64, 2)
        assert tensors[base + "down_proj_blocks"].shape == (8, 64, 1, 16)
        assert tensors[base + "down_proj_scales"].dtype == tensors[base + "down_proj_blocks"].dtype == torch.uint8
        assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32  # experts only
        assert json.loads((q / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert tensors["lm_head.weight"].dtype == torch.float32


def test_pool_bytes_dequantize_to_the_checkpoint_bit_for_bit(built):
    q, deq, fmt = built
    reader = CheckpointReader(TensorIndex.scan(q))
    cfg = ModelConfig.from_dir(q)
    layout = fmt.layout(cfg.hidden_size, cfg.moe_intermediate_size)
    packed = read_experts(
        reader,
        quant_spec(cfg.raw, q),
        layout,
        cfg.num_experts,
        0,
        text_prefix(reader, cfg),
    )
    gate_up, down = ref.dequantize_experts(layout, packed)
    want = load_file(deq / "model.safetensors")
    if "model.layers.0.mlp.experts.gate_up_proj" in want:
        assert torch.equal(gate_up, want["model.layers.0.mlp.experts.gate_up_proj"])
        assert torch.equal(down, want["model.layers.0.mlp.experts.down_proj"])
    else:
        for e in range(cfg.num_experts):
            base = f"model.layers.0.mlp.experts.{e}."
            assert torch.equal(gate_up[e, :32], want[base + "gate_proj.weight"])
            assert torch.equal(gate_up[e, 32:], want[base + "up_proj.weight"])
            assert torch.equal(down[e], want[base + "down_proj.weight"])


def test_cpu_model_with_quantized_experts_matches_dequantized_float_model(built):
    """The fused backend on the CPU (float32): quantized experts dequantized on the fly and FP8 linears dequantized
    on load give the float model's logits. Same float32 values, same operations: agreement to 1e-5 (it is exact
    today; the tolerance leaves room for a kernel that sums in another order)."""
    q, deq, _ = built
    experts = FusedExperts()
    model = load_checkpoint(q, experts, torch.device("cpu"), torch.float32)
    assert experts.quantized and not experts.gate_up
    got = _logits(model)
    want = _logits(load_checkpoint(deq, FusedExperts(), torch.device("cpu"), torch.float32))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert experts.nbytes < 0.3 * 3 * 64 * 32 * 4 * 8 * 2  # a quarter (FP8) or an eighth (NVFP4) of float32
    # /v1/stats and the expert-size gauge read these, as from the expert cache's backends
    layout = next(iter(experts.quantized.values())).layout
    assert experts.stats() == {
        "backend": "fused",
        "expert_format": built[2].name,
        "expert_nbytes": layout.expert_nbytes,
    }
    dense = FusedExperts()
    load_checkpoint(deq, dense, torch.device("cpu"), torch.float32)
    assert dense.stats() == {"backend": "fused", "expert_format": "float32", "expert_nbytes": 3 * 64 * 32 * 4}


def _edit(src: Path, dest: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"),
            "experts.3.up_proj.weight_scale_inv' missing",
        ),
        (
            lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"),
            "o_proj.weight_scale_inv' missing",
        ),
        (
            lambda t: t.update({"model.layers.2.mlp.experts.0.down_proj.weight_scale_inv": torch.ones(2, 2)}),
            r"down_proj.weight_scale_inv' has shape \[2, 2\], expected \[2, 1\]",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.1.gate_proj.weight_scale_inv": torch.ones(1, 2, dtype=torch.int32)}
            ),
            "gate_proj.weight_scale_inv' has dtype I32; expected one of F32, BF16, F16",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.1.gate_proj.weight": torch.zeros(32, 64, dtype=torch.uint8)}
            ),
            "gate_proj.weight' has dtype U8; expected one of F8_E4M3",
        ),
    ],
)
def test_broken_fp8_checkpoints_name_the_tensor(tmp_path_factory, edit, message):
    root = tmp_path_factory.mktemp("broken")
    src = build_quantized_checkpoint(root / "q", FP8_SMALL, seed=1, **SMALL)
    bad = _edit(src, root / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(bad, FusedExperts(), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_fp8_scales_stored_in_16_bits_load_as_float32(tmp_path_factory, dtype):
    """Some Qwen FP8 releases store `weight_scale_inv` in bf16 or float16: such a checkpoint loads, experts and
    linears, and gives the logits of the same scales stored in float32 (widened exactly), bit for bit."""
    root = tmp_path_factory.mktemp("scales16")
    src = build_quantized_checkpoint(root / "q", FP8_SMALL, seed=1, **SMALL)

    def rounded(store):
        def edit(tensors):
            for name in [n for n in tensors if n.endswith("scale_inv")]:
                tensors[name] = tensors[name].to(dtype).to(store)

        return edit

    wide = _edit(src, root / "f32", rounded(torch.float32))
    narrow = _edit(src, root / "narrow", rounded(dtype))
    assert load_file(narrow / "model.safetensors")["model.layers.0.self_attn.o_proj.weight_scale_inv"].dtype == dtype
    got = _logits(load_checkpoint(narrow, FusedExperts(), torch.device("cpu"), torch.float32))
    want = _logits(load_checkpoint(wide, FusedExperts(), torch.device("cpu"), torch.float32))
    assert torch.equal(got, want)


MX = "model.layers.0.mlp.experts."


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(MX + "gate_up_proj_scales"), r"experts\.gate_up_proj_scales' missing .*\[8, 64, 2\]"),
        (
            lambda t: t.update({MX + "down_proj_scales": torch.zeros(8, 64, 2, dtype=torch.uint8)}),
            r"experts\.down_proj_scales' has shape \[8, 64, 2\], expected \[8, 64, 1\]",
        ),
        (
            lambda t: t.update({MX + "down_proj_scales": torch.zeros(8, 64, 1, dtype=torch.float8_e8m0fnu)}),
            r"experts\.down_proj_scales' has dtype F8_E8M0; expected one of U8",
        ),
        (
            lambda t: t.update({MX + "gate_up_proj_blocks": t[MX + "gate_up_proj_blocks"].reshape(8, 64, 32)}),
            r"experts\.gate_up_proj_blocks' has shape \[8, 64, 32\], expected \[8, 64, 2, 16\]",
        ),
        (
            lambda t: t.update({MX + "down_proj_blocks": t[MX + "down_proj_blocks"].view(torch.int8)}),
            r"experts\.down_proj_blocks' has dtype I8; expected one of U8",
        ),
        (  # per-expert float experts under an mxfp4 config: no released MXFP4 layout has them
            lambda t: [t.pop(MX + n) for n in ("gate_up_proj_blocks", "gate_up_proj_scales")],
            r"experts\.gate_up_proj_blocks' missing from the checkpoint: MXFP4 experts are read in the fused 3-D",
        ),
        (  # MXFP4 checkpoints quantize the routed experts only
            lambda t: t.update({"model.layers.2.self_attn.o_proj.weight": torch.zeros(64, 64, dtype=torch.uint8)}),
            r"o_proj\.weight' has dtype U8; expected one of F32, BF16, F16",
        ),
    ],
    ids=["no-scales", "scales-shape", "scales-e8m0-dtype", "blocks-shape", "blocks-dtype", "no-blocks", "u8-linear"],
)
def test_broken_mxfp4_checkpoints_name_the_tensor(tmp_path_factory, edit, message):
    """The fused loader and the host pool's reader refuse a broken MXFP4 checkpoint, naming the tensor and what is
    expected."""
    from freetoken.moe import build_expert_pool

    root = tmp_path_factory.mktemp("broken-mxfp4")
    src = build_quantized_checkpoint(root / "q", MXFP4, seed=1, expert_layout="fused", **SMALL)
    bad = _edit(src, root / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(bad, FusedExperts(), torch.device("cpu"), torch.float32)
    if "experts" in message:
        with pytest.raises(CheckpointError, match=message):
            build_expert_pool(ModelConfig.from_dir(bad), bad)


def test_mxfp4_checkpoints_are_built_fused_only(tmp_path):
    with pytest.raises(ValueError, match="expert_layout='fused'"):
        build_quantized_checkpoint(tmp_path / "q", MXFP4, seed=1, **SMALL)


def test_unsupported_quantization_is_refused_at_load(tmp_path):
    src = build_quantized_checkpoint(tmp_path / "q", FP8_SMALL, seed=1, **SMALL)
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(QuantConfigError, match="quant_method='gptq'"):
        load_checkpoint(src, FusedExperts(), torch.device("cpu"), torch.float32)


def test_quant_spec_converts_prefixes():
    spec = QuantSpec(fp8_block(), ("model.layers.1.mlp",))
    assert not spec.converts("model.layers.1.mlp.experts.0.gate_proj") and spec.converts("model.layers.10.mlp.gate")


@pytest.mark.cuda_mocked  # a CUDA memory plan, computed on the host: nothing touches a device
def test_host_memory_plan_counts_quantized_experts_at_their_size():
    from freetoken.config import EngineConfig
    from freetoken.moe.budget import plan_host_memory

    raw = json.loads(REAL_FP8_CONFIG.read_text())
    cfg = ModelConfig.from_dict(raw)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert cfg.expert_nbytes == fp8_block().layout(h, i).expert_nbytes < 0.51 * 2 * cfg.expert_numel
    plan = plan_host_memory(EngineConfig(device="cuda", gpu_memory_gb=24), cfg, torch.bfloat16, "offload")
    assert plan["expert pool"][0] == len(cfg.moe_layers) * cfg.num_experts * cfg.expert_nbytes
    bf16 = ModelConfig.from_dict({k: v for k, v in raw.items() if k != "quantization_config"})
    assert plan_host_memory(EngineConfig(device="cuda", gpu_memory_gb=24), bf16, torch.bfloat16, "offload")[
        "expert pool"
    ][0] == (len(cfg.moe_layers) * cfg.num_experts * 2 * cfg.expert_numel)


@pytest.mark.cuda_mocked  # a CUDA memory plan, computed on the host: nothing touches a device
def test_host_memory_plan_reads_a_modelopt_hf_quant_config(tmp_path):
    """A ModelOpt export that declares NVFP4 only in hf_quant_config.json is sized as NVFP4 in the memory plan (as
    the loader reads it), not as bf16: its config.json has no quantization_config."""
    from freetoken.config import EngineConfig
    from freetoken.moe.budget import plan_host_memory

    raw = {k: v for k, v in json.loads(REAL_FP8_CONFIG.read_text()).items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}})
    )
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.expert_nbytes == NVFP4.layout(cfg.hidden_size, cfg.moe_intermediate_size).expert_nbytes
    plan = plan_host_memory(EngineConfig(device="cuda", gpu_memory_gb=24), cfg, torch.bfloat16, "offload")
    assert plan["expert pool"][0] == len(cfg.moe_layers) * cfg.num_experts * cfg.expert_nbytes
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "AWQ"}}))
    with pytest.raises(QuantConfigError, match="hf_quant_config"):
        _ = ModelConfig.from_dir(tmp_path).expert_nbytes
