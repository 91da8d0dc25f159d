"""freetoken's Qwen3.5-MoE against transformers' `qwen3_5_moe` on the CPU in float32, and its parts.

Targets (issue 22): logits max abs diff <= 1e-4 and 32 greedy tokens identical, on scaled-down configs of the real
Qwen3.5-35B-A3B config (conditional-generation and causal-LM checkpoints), alone and batched, with prefill chunks
that cut sequences (and the delta rule's 64-token chunks) anywhere; both expert layouts; every expert backend; the
recurrent-state pool's slots through admission, finish, abort and preemption. GPU checks are marked `gpu`:
    python -m pytest tests/models/test_qwen3_5.py -q -m gpu
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.kernels.gated_delta import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_torch,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_torch,
)
from freetoken.models.attention import AttentionMetadata
from gpu_marker import gpu_when_available
from greedy import greedy_tokens, hf_greedy
from reference_qwen3_5 import check_bfloat16_against_transformers, make_reference_checkpoint

# Where the Triton-kernel tests run: CUDA when there is one, else Triton's interpreter on the CPU (conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# name -> (seed, overrides of the scaled-down config).
CONFIGS = {
    "conditional-generation": (0, {}),
    "causal-lm": (1, {"causal_lm": True}),
    "two-full-layers": (2, {"num_hidden_layers": 8, "full_attention_interval": 2}),
    "tied-conv3-top3": (3, {"tie_word_embeddings": True, "linear_conv_kernel_dim": 3, "num_experts_per_tok": 3}),
}

PROMPTS = [
    [3, 17, 100, 42, 7, 8, 9, 200, 13],
    [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] * 4 + [77],  # 81: two delta-rule chunks
]


def _engine(path, **kwargs) -> LLMEngine:
    cfg = EngineConfig(device="cpu", dtype="float32", moe_backend=kwargs.pop("moe_backend", "fused"), **kwargs)
    return LLMEngine.from_dir(path, cfg)


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    seed, overrides = CONFIGS[request.param]
    model = make_reference_checkpoint(path, seed=seed, **overrides)
    return path, model


@pytest.fixture(scope="module")
def expected(checkpoint):
    """transformers' 32 greedy tokens of each prompt."""
    _, ref = checkpoint
    out = [hf_greedy(ref, p) for p in PROMPTS]
    assert all(len(set(o)) > 3 for o in out), "degenerate reference output; the test would prove little"
    return out


def test_config_reads_the_real_checkpoints():
    """The real config (nested text_config) and the REAP derivative's (flat) give the real structure."""
    for sub, experts in (("", 256), ("derived-REAP-18B-A3B", 128)):
        from freetoken.models.presets import preset_config_path

        raw = json.loads(preset_config_path("qwen3.5-35b-a3b").read_text())
        if sub:  # the derivative's keys at the top level
            raw = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"], "num_experts": 128}
        cfg = ModelConfig.from_dict(raw)
        assert cfg.num_experts == experts and cfg.num_experts_per_tok == 8 and cfg.num_hidden_layers == 40
        assert cfg.full_attention_layers == list(range(3, 40, 4)) and len(cfg.linear_layers) == 30
        assert cfg.rotary_dim == 64 and cfg.attn_output_gate and cfg.shared_expert_intermediate_size == 512
        assert cfg.weight_prefix == "model.language_model." and cfg.norm_topk_prob and cfg.moe_layers == list(range(40))


def test_logits_match_reference(checkpoint):
    path, ref = checkpoint
    engine = _engine(path)
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        assert (_prompt_logits(engine, prompt) - expected).abs().max().item() <= 1e-4


def test_greedy_tokens_match_reference(checkpoint, expected):
    path, _ = checkpoint
    assert [greedy_tokens(_engine(path), [p], 32)[0] for p in PROMPTS] == expected
    # Both in one batch, prefill chunks of 7 tokens (a step mixes one sequence's chunk with the other's decode) and
    # tiny KV blocks: every chunk boundary continues the conv window and the delta-rule state from the pool.
    assert greedy_tokens(_engine(path, max_prefill_tokens=7, kv_block_size=4), PROMPTS, 32) == expected


def test_preemption_recomputes_from_a_zeroed_state(checkpoint, expected):
    """A KV cache too small for both sequences preempts the newer; its recompute must start from a zero state (a
    slot left with another sequence's state would change its tokens)."""
    path, _ = checkpoint
    engine = _engine(path, kv_cache_tokens=128, kv_block_size=4, max_model_len=128)
    assert greedy_tokens(engine, PROMPTS, 32) == expected
    assert engine.state_pool.num_free == engine.state_pool.num_slots


def test_state_slots_follow_sequences(checkpoint):
    """A slot per running sequence, given back on finish and abort; a waiting request holds none."""
    path, _ = checkpoint
    engine = _engine(path, max_num_seqs=2)
    pool = engine.state_pool
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), PROMPTS[0], params)
    engine.step()
    running = engine.scheduler.running
    assert len(running) == 2 and pool.num_free == 0
    assert sorted(s.state_slot for s in running) == [0, 1]
    assert engine.scheduler.waiting[0].state_slot == -1
    engine.abort("0")
    assert pool.num_free == 1
    while engine.has_work():
        engine.step()
    assert pool.num_free == 2


def _prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """float32 logits of every position of `prompt`, one eager step from a fresh state slot."""
    model = engine.runner.model
    n = len(prompt)
    meta = AttentionMetadata.build(
        [n], [n], [list(range(engine.kv.blocks_for(n)))], engine.kv.block_size, engine.device
    )
    slot = engine.state_pool.allocate()
    meta.state_slots = torch.tensor([slot])
    model.experts.begin_step(n, n, model.config.num_experts_per_tok)
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(prompt), meta, engine.kv.layers))
    engine.state_pool.free(slot)
    return logits


def test_fused_expert_layout_loads_the_same(checkpoint, expected, tmp_path):
    """The fused 3-D expert tensors (the released checkpoints) give the same model as one tensor per expert (what
    transformers saves)."""
    path, _ = checkpoint
    tensors = load_file(path / "model.safetensors")
    cfg = ModelConfig.from_dir(path)
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in cfg.moe_layers:
        p = f"{prefix}layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
                for e in range(cfg.num_experts)
            ]
        )
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(cfg.num_experts)])
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    save_file(fused, tmp_path / "model.safetensors")
    assert greedy_tokens(_engine(tmp_path), PROMPTS[:1], 8) == [expected[0][:8]]


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_host_pool_backends_match_fused(layout, tmp_path):
    """The routed experts of Qwen3.5 layers go through the expert-cache backends as Qwen3-MoE's do (the pool read
    from `model.language_model.*` names in either layout): offload (every miss filled into a slot) matches
    fused to float32 rounding; cpu (bf16 inputs to the host kernels) to bf16 rounding. Weights stored in bf16, so the
    pool holds exactly the fused weights."""
    from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint

    path = build_qwen3_5_demo_checkpoint(tmp_path, seed=3, expert_layout=layout, num_experts=16, num_experts_per_tok=4)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors")
    prompt = PROMPTS[1][:40]
    fused = _prompt_logits(_engine(path), prompt)
    scale = fused.abs().max().item()
    # Half the pool in slots: the first pass fills (the slots' float32 compute); tolerances relative to the largest
    # logit as in test_moe_backends.
    offload = _prompt_logits(_engine(path, moe_backend="offload", expert_slots=32), prompt)
    assert (offload - fused).abs().max().item() <= 1e-5 * scale
    cpu = _prompt_logits(_engine(path, moe_backend="cpu"), prompt)
    assert (cpu - fused).abs().max().item() <= 2e-3 * scale


def test_chunked_rule_matches_recurrent():
    """The chunked form (spans of any length, from any state) equals the token-by-token recurrence."""
    torch.manual_seed(0)
    heads_k, heads_v, dk, dv = 2, 6, 16, 8
    state = torch.randn(heads_v, dk, dv)
    for length in (1, 5, 64, 65, 150):
        q, k = torch.randn(length, heads_k, dk), torch.randn(length, heads_k, dk)
        v = torch.randn(length, heads_v, dv)
        g, beta = -torch.rand(length, heads_v) * 2, torch.rand(length, heads_v)
        out, final = chunk_gated_delta_rule_torch(q, k, v, g, beta, state)
        states = state[None].repeat(2, 1, 1, 1)
        steps = [
            recurrent_gated_delta_rule_torch(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], states, torch.tensor([1])
            )
            for t in range(length)
        ]
        torch.testing.assert_close(out, torch.cat(steps), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(final, states[1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(states[0], state)  # other slots untouched


@pytest.fixture
def on_kernel_device():
    """New tensors on DEVICE for the test's duration."""
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device("cpu")


@gpu_when_available
def test_recurrent_kernel_matches_torch(on_kernel_device):
    """The Triton decode kernel (Triton's interpreter on the CPU) against the torch recurrence, odd sizes, padding
    rows that share the scratch slot, a bf16 input."""
    torch.manual_seed(1)
    for dtype, dv in ((torch.float32, 24), (torch.bfloat16, 64)):
        batch, heads_k, heads_v, dk = 3, 2, 4, 16
        q, k = torch.randn(batch, heads_k, dk, dtype=dtype), torch.randn(batch, heads_k, dk, dtype=dtype)
        v = torch.randn(batch, heads_v, dv, dtype=dtype)
        g, beta = -torch.rand(batch, heads_v), torch.rand(batch, heads_v).to(dtype)
        states = torch.randn(5, heads_v, dk, dv)
        slots = torch.tensor([2, 0, 3])
        want_states = states.clone()
        want = recurrent_gated_delta_rule_torch(q, k, v, g, beta, want_states, slots)
        got = recurrent_gated_delta_rule(q, k, v, g, beta, states, slots)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-5)


def test_demo_checkpoint_matches_reference_in_both_layouts(tmp_path):
    """The Qwen3.5 demo builder's checkpoint loads in transformers (the vision tower it omits is the only thing
    transformers reports missing) and in freetoken, with the same logits; its two expert layouts and a sharded
    write give the same tokens."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint

    fused = build_qwen3_5_demo_checkpoint(tmp_path / "fused", seed=5)
    per_expert = build_qwen3_5_demo_checkpoint(
        tmp_path / "per-expert", seed=5, expert_layout="per_expert", num_shards=3
    )
    ref, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(per_expert, output_loading_info=True)
    assert all(name.startswith("model.visual.") for name in info["missing_keys"])
    assert not info["unexpected_keys"]
    prompt = PROMPTS[1]
    engine = _engine(fused)
    model = engine.runner.model
    meta = AttentionMetadata.build(
        [len(prompt)],
        [len(prompt)],
        [list(range(engine.kv.blocks_for(len(prompt))))],
        engine.kv.block_size,
        engine.device,
    )
    meta.state_slots = torch.tensor([engine.state_pool.allocate()])
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(prompt), meta, engine.kv.layers))
        want = ref.eval()(torch.tensor([prompt])).logits[0]
    assert (got - want).abs().max().item() <= 1e-4
    assert greedy_tokens(_engine(fused), PROMPTS, 6) == greedy_tokens(_engine(per_expert), PROMPTS, 6)


def test_preset_plans_the_real_model():
    """`ft serve --model qwen3.5-35b-a3b --dummy-weights` resolves to the real config; the GPU plan counts the state
    pool (30 linear layers x (32 x 128 x 128 float32 + 8192 x 3 conv) per sequence) and 10 KV layers."""
    from freetoken.cli.serve import resolve_model_dir
    from freetoken.engine.kv_cache import plan_kv_cache
    from freetoken.engine.state_pool import RecurrentStatePool
    from freetoken.moe.budget import non_expert_nbytes, state_pool_nbytes

    cfg = ModelConfig.from_dir(resolve_model_dir("qwen3.5-35b-a3b", dummy_weights=True))
    assert cfg.num_experts == 256 and cfg.num_kv_layers == 10
    assert RecurrentStatePool.bytes_per_slot(cfg, torch.bfloat16) == 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    engine_cfg = EngineConfig(max_num_seqs=4, max_model_len=4096)
    per_slot = RecurrentStatePool.bytes_per_slot(cfg, torch.bfloat16)
    assert state_pool_nbytes(engine_cfg, cfg, torch.bfloat16) == 5 * per_slot
    assert plan_kv_cache(cfg, engine_cfg, torch.bfloat16).nbytes == (4 * 4096 // 16 + 1) * 16 * 2 * 10 * 2 * 256 * 2
    # Attention, DeltaNet, norms, routers, shared experts, embeddings and LM head: about 2.3 G parameters.
    assert 4.0e9 < non_expert_nbytes(cfg, torch.bfloat16) < 5.5e9


@gpu_when_available
def test_chunk_kernels_match_torch(on_kernel_device):
    """The Triton prefill kernels (Triton's interpreter on the CPU): spans shorter than, equal to and past a 64-token
    chunk, grouped value heads, Dv not a power of two, from a non-zero state advanced in place."""
    torch.manual_seed(2)
    for length, heads_k, heads_v, dk, dv in ((5, 2, 4, 16, 16), (64, 1, 2, 16, 24), (130, 2, 2, 32, 32)):
        q, k = torch.randn(length, heads_k, dk), torch.randn(length, heads_k, dk)
        v = torch.randn(length, heads_v, dv)
        g, beta = -torch.rand(length, heads_v) * 2, torch.rand(length, heads_v)
        state = torch.randn(heads_v, dk, dv)
        want, want_state = chunk_gated_delta_rule_torch(q, k, v, g, beta, state)
        got = chunk_gated_delta_rule(q, k, v, g, beta, state)
        tol = 1e-5 if DEVICE == "cpu" else 1e-4  # CUDA: other summation orders in the matmuls
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        torch.testing.assert_close(state, want_state, atol=tol, rtol=tol)


@gpu_when_available
def test_chunk_kernels_in_passes_equal_one_pass(on_kernel_device, monkeypatch):
    """A span longer than `PASS_TOKENS` runs in passes with the state carried between them: the same outputs and
    state as one pass, bit for bit (the passes end on chunk boundaries), so the scratch is bounded at no cost."""
    from freetoken.kernels import gated_delta

    torch.manual_seed(4)
    length, heads_k, heads_v, dk, dv = 150, 1, 2, 16, 16
    q, k = torch.randn(length, heads_k, dk), torch.randn(length, heads_k, dk)
    v = torch.randn(length, heads_v, dv)
    g, beta = -torch.rand(length, heads_v) * 2, torch.rand(length, heads_v)
    state = torch.randn(heads_v, dk, dv)
    one_state = state.clone()
    one = chunk_gated_delta_rule(q, k, v, g, beta, one_state)
    monkeypatch.setattr(gated_delta, "PASS_TOKENS", 64)
    split = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(split, one)
    assert torch.equal(state, one_state)
    assert gated_delta.chunk_scratch_nbytes(length, heads_v, dk, dv) == 4 * (64 * 2 * 33 + 2 * 256)


def _bf16_steps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per element, how many bfloat16 values lie between two bfloat16 tensors (0: equal)."""
    a, b = (x.view(torch.int16).int() for x in (got, want))
    # Sign-magnitude bits to a monotonic integer line, so steps across zero count too.
    a, b = (torch.where(x < 0, -(x & 0x7FFF), x) for x in (a, b))
    return (a - b).abs()


# float32 states and sums: the tolerance `test_chunk_kernels_match_torch` holds on each device.
STATE_TOL = 1e-5 if DEVICE == "cpu" else 1e-4


def _assert_rounds_as_torch(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 outputs rounded where torch rounds them. Under the interpreter: equal but for a rare one-step tie. On
    CUDA the float32 sums run in other orders (up to `STATE_TOL` apart, as in float32), and an output that nearly
    cancels is a few bfloat16 steps from torch's by that alone (14 steps, 2 of 10,240 outputs, measured on the H200):
    each output within that sum error plus one rounding step (2^-7 relative) of torch's, and still almost all equal."""
    steps = _bf16_steps_apart(got, want)
    assert (steps > 0).float().mean() < 0.01, (steps > 0).float().mean()
    if DEVICE == "cpu":
        assert steps.max() <= 1, steps.max()
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=STATE_TOL, rtol=2**-7 + STATE_TOL)


@gpu_when_available
def test_kernels_round_bfloat16_as_torch(on_kernel_device):
    """bfloat16 q/k/v (and beta): the Triton prefill and decode kernels (Triton's interpreter on the CPU, which the
    conftest makes round to nearest as the GPU does) give torch's bfloat16 outputs, bit for bit except a rare one-ulp
    tie of their float32 sums, and its float32 states: no intermediate is rounded to bfloat16 where torch keeps
    float32 (the l2norm, the decay and beta, the output's one rounding). On CUDA the float32 sums run in other orders
    (`_assert_rounds_as_torch`)."""
    torch.manual_seed(5)
    dtype = torch.bfloat16
    length, heads_k, heads_v, dk, dv = 80, 2, 4, 32, 32
    q, k = torch.randn(length, heads_k, dk, dtype=dtype), torch.randn(length, heads_k, dk, dtype=dtype)
    v = torch.randn(length, heads_v, dv, dtype=dtype)
    g, beta = -torch.rand(length, heads_v) * 2, torch.rand(length, heads_v).to(dtype)
    state = torch.randn(heads_v, dk, dv)
    want, want_state = chunk_gated_delta_rule_torch(q, k, v, g, beta, state)
    got = chunk_gated_delta_rule(q, k, v, g, beta, state)
    _assert_rounds_as_torch(got, want)
    torch.testing.assert_close(state, want_state, atol=STATE_TOL, rtol=STATE_TOL)
    states = torch.randn(6, heads_v, dk, dv)
    want_states, slots = states.clone(), torch.tensor([4, 1, 0])
    want = recurrent_gated_delta_rule_torch(q[:3], k[:3], v[:3], g[:3], beta[:3], want_states, slots)
    got = recurrent_gated_delta_rule(q[:3], k[:3], v[:3], g[:3], beta[:3], states, slots)
    _assert_rounds_as_torch(got, want)
    torch.testing.assert_close(states, want_states, atol=STATE_TOL, rtol=STATE_TOL)


# Shared memory per block on the H200 (sm_90: 227 KiB opt-in), and the share of it a kernel may take, leaving room
# for Triton's other versions of the tiling and for GPUs with less.
H200_SHARED_MEMORY = 232_448
SHARED_MEMORY_MARGIN = 0.75


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["prepare", "state", "output"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_chunk_kernels_fit_shared_memory(dtype, kernel):
    """Each prefill kernel at Qwen3.5-35B-A3B's head sizes (Dk = Dv = 128, value heads in groups of 2), with the
    launch `chunk_gated_delta_rule` gives it (`LAUNCH`, `DOT_PRECISION`), needs at most 3/4 of the H200's shared
    memory per block, from Triton's compiler for sm_90 without a GPU (tests/triton_shared_memory.py; the old scan
    kernel's 3 pipeline stages needed 296,456 B in float32, over the limit). In a subprocess: the interpreter this
    suite runs under compiles nothing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from freetoken.kernels.gated_delta import CHUNK_SIZE, DOT_PRECISION, LAUNCH

    warps, stages, block_v = LAUNCH[kernel]
    elem = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    floats = {"w_ptr", "u_ptr", "gcum_ptr", "state_ptr", "h_ptr", "g_ptr"}
    names = ("q_ptr", "k_ptr", "v_ptr", "beta_ptr", "o_ptr", *floats)
    signature = {n: "*fp32" if n in floats else f"*{elem}" for n in names} | {"length": "i32", "scale": "fp32"}
    constexprs = {"GROUP": 2, "CHUNK": CHUNK_SIZE, "DK": 128, "DV": 128, "PRECISION": DOT_PRECISION}
    constexprs |= {"DV_PAD": 128} if kernel == "prepare" else {"BLOCK_V": block_v}
    name = f"_chunk_{kernel}_kernel"
    spec = {"signature": signature, "num_stages": stages, "num_warps": warps, "constexprs": constexprs}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    helper = Path(__file__).parents[1] / "triton_shared_memory.py"
    done = subprocess.run(
        [sys.executable, str(helper), "freetoken.kernels.gated_delta", name, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
        check=True,
    )
    need = int(done.stdout.split()[-1])
    assert need <= SHARED_MEMORY_MARGIN * H200_SHARED_MEMORY, f"{name}: {need} B of shared memory with {spec}"


@gpu_when_available
def test_deltanet_layer_with_kernels_matches_torch(monkeypatch, tmp_path):
    """A Gated DeltaNet layer through the Triton kernels (on CUDA, or interpreted on the CPU) against its torch path,
    on the strided views the layer feeds them: a step of two prefill spans, then a decode step, states compared after
    each."""
    from freetoken.engine.state_pool import RecurrentStatePool
    from freetoken.models import qwen3_5_moe
    from freetoken.models.demo_qwen3_5 import qwen3_5_demo_config

    raw = qwen3_5_demo_config()
    cfg = ModelConfig.from_dict(raw)
    torch.manual_seed(0)
    layer = qwen3_5_moe.GatedDeltaNet(cfg, 0)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    layer = layer.to(DEVICE)
    pools = [RecurrentStatePool(cfg, 3, torch.float32, torch.device(DEVICE)) for _ in range(2)]
    for pool in pools:
        pool.allocate(), pool.allocate()

    def run(pool, x, query_lens, kernels):
        monkeypatch.setattr(qwen3_5_moe, "KERNEL_DEVICES", {DEVICE} if kernels else set())
        meta = AttentionMetadata(
            positions=None,
            slot_mapping=None,
            query_lens=query_lens,
            context_lens=[],
            decode_gather=None,
            decode_mask=None,
            decode_rows=None,
            prefill_spans=[],
            state_slots=torch.tensor([1, 0], device=DEVICE),
        )
        with torch.no_grad():
            return layer(x.to(DEVICE), pool.layers[0], meta)

    for x, query_lens in ((torch.randn(12, cfg.hidden_size), [7, 5]), (torch.randn(2, cfg.hidden_size), [1, 1])):
        want, got = run(pools[0], x, query_lens, False), run(pools[1], x, query_lens, True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for a, b in zip(pools[0].layers[0], pools[1].layers[0], strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_prefix_cache_is_off_for_hybrids_without_checkpoints_and_a_skipped_prefix_is_refused(tmp_path):
    """The KV prefix cache cannot resume linear layers without a snapshot of their state
    (`freetoken.engine.state_checkpoints`): with `--state-checkpoints off` a hybrid engine runs with it off; were it
    on, admission still resumes only from a snapshot (none: the prompt is prefilled in full), and a sequence handed
    cached K/V without one is refused loudly."""
    from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint

    engine = _engine(build_qwen3_5_demo_checkpoint(tmp_path, seed=1), state_checkpoints="off")
    assert not engine.scheduler.prefix_cache.enabled and engine.checkpoints is None
    engine.scheduler.prefix_cache.enabled = True
    params = SamplingParams(max_tokens=2, temperature=0.0)
    outputs = {}
    for rid in ("first", "second"):
        engine.add_request(rid, PROMPTS[1], params)
        while engine.has_work():
            for out in engine.step():
                outputs.setdefault(rid, []).append(out.chunk)
    assert outputs["second"][-1].num_cached_tokens == 0
    assert [c.token_ids for c in outputs["second"]] == [c.token_ids for c in outputs["first"]]
    scheduler = engine.scheduler
    engine.add_request("third", PROMPTS[1], params)
    seq = scheduler.waiting[0]
    match = scheduler.prefix_cache.match(seq.token_ids)
    assert match.num_blocks > 0
    with pytest.raises(RuntimeError, match="without a recurrent-state snapshot"):
        scheduler._admit(seq, match, 64)
    assert engine.state_pool.num_free == engine.state_pool.num_slots


def test_paused_sequences_keep_their_state_slots(tmp_path):
    """A paused sequence (its client stopped reading) keeps its state slot as it keeps its KV blocks, so a new
    request waits for a slot instead of failing to get one; it is admitted once the paused one goes."""
    from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint

    engine = _engine(build_qwen3_5_demo_checkpoint(tmp_path, seed=1), max_num_seqs=2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[0], params)
    engine.step()
    engine.pause("a")
    engine.add_request("c", PROMPTS[0], params)
    engine.step()
    waiting = engine.scheduler.waiting
    assert [s.request_id for s in waiting] == ["c"] and waiting[0].state_slot == -1
    assert engine.state_pool.num_free == 0
    engine.abort("a")
    engine.step()
    assert not engine.scheduler.waiting and engine.state_pool.num_free == 0
    while engine.has_work():
        engine.step()
    assert engine.state_pool.num_free == 2


def test_bfloat16_follows_transformers_on_the_cpu(tmp_path):
    """The GPU test's bfloat16 check on the CPU (torch paths), two of its four seeds: logits as close to exact
    compute as transformers' own bfloat16, tokens equal but from near-ties within its bfloat16 error."""
    print(check_bfloat16_against_transformers(tmp_path, "cpu", seeds=2))
