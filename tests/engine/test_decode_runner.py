"""The fixed-shape decode step (the runners of `freetoken.engine.cuda_graph`: Triton paged attention, static buffers;
the whole step, or spans staged around the routed experts) gives the tokens of the eager torch path. On the CPU it
runs uncaptured, with the Triton kernels in the interpreter; on CUDA (tests/engine/test_gpu.py) the same steps run as
CUDA graphs, and the driven runner's there only."""

from __future__ import annotations

import os

import pytest

from freetoken.config import EngineConfig
from freetoken.engine.cuda_graph import StagedRunner, WholeStepRunner, make_decode_runner
from freetoken.engine.llm_engine import LLMEngine
from freetoken.models.demo import build_demo_checkpoint
from greedy import greedy_tokens

PROMPTS = [[3, 17, 100, 42, 7], [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_demo_checkpoint(tmp_path_factory.mktemp("demo"), seed=11, mlp_only_layers=[1])


def _greedy(engine: LLMEngine) -> list[list[int]]:
    return greedy_tokens(engine, PROMPTS, 6)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter (conftest sets it without a GPU)",
)
@pytest.mark.parametrize(
    "backend,runner_type",
    [("fused", WholeStepRunner), ("fused", StagedRunner), ("offload", StagedRunner), ("cpu", StagedRunner)],
)
def test_decode_runner_equals_torch_path(checkpoint, backend, runner_type):
    """fused through `forward` between staged spans, the expert cache's modes through `forward_staged`."""
    cfg = EngineConfig(device="cpu", dtype="float32", moe_backend=backend, max_num_seqs=3, kv_block_size=4)
    expected = _greedy(LLMEngine.from_dir(checkpoint, cfg))
    engine = LLMEngine.from_dir(checkpoint, cfg)
    runner = engine.runner
    runner.decode = runner_type(runner.model, engine.kv, cfg.max_num_seqs, engine.max_model_len, use_graphs=False)
    assert _greedy(engine) == expected


@pytest.mark.parametrize("backend,runner_type", [("fused", WholeStepRunner), ("offload", StagedRunner)])
def test_the_backend_declares_its_runner(checkpoint, backend, runner_type):
    """`make_decode_runner` picks from what the backend declares: `graph_safe` (fused) the whole step; a
    `DrivenExpertBackend` without graphs (here the CPU device) the staged spans, through `forward_staged`. (With
    graphs on CUDA the driven runner: tests/engine/test_gpu.py.)"""
    cfg = EngineConfig(device="cpu", dtype="float32", moe_backend=backend, max_num_seqs=3, kv_block_size=4)
    engine = LLMEngine.from_dir(checkpoint, cfg)
    runner = make_decode_runner(engine.runner.model, engine.kv, 3, engine.max_model_len, use_graphs=False)
    assert type(runner) is runner_type and not runner.captured
    if isinstance(runner, StagedRunner):
        assert runner.driven is engine.experts


def test_the_driven_handshake_needs_cuda(checkpoint):
    """The expert cache on the CPU device has no CUDA graphs to drive: asking it for the handshake is an error
    (the engine never does: graphs are off there), not a None the caller must probe for."""
    cfg = EngineConfig(device="cpu", dtype="float32", moe_backend="offload", max_num_seqs=3, kv_block_size=4)
    engine = LLMEngine.from_dir(checkpoint, cfg)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        engine.experts.device_handshake(2, [1, 2])


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter (conftest sets it without a GPU)",
)
def test_fused_layer_kernels_give_the_torch_path_logprobs(checkpoint, monkeypatch):
    """The model's CUDA path (one GEMM for q/k/v, the fused RMSNorm and router kernels of
    `freetoken.kernels.layer_ops`) run on the CPU in the interpreter: the same tokens and log-probabilities as the
    torch ops, prefill and decode."""
    from freetoken.engine.types import SamplingParams
    from freetoken.models import qwen3_moe

    cfg = EngineConfig(device="cpu", dtype="float32", moe_backend="fused", max_num_seqs=3, kv_block_size=4)

    def run() -> list[tuple[list[int], list[float]]]:
        engine = LLMEngine.from_dir(checkpoint, cfg)
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params)
        out = {f"r{i}": ([], []) for i in range(len(PROMPTS))}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id][0].extend(o.chunk.token_ids)
                out[o.request_id][1].extend(lp.logprob for lp in o.chunk.logprobs)
        return [out[f"r{i}"] for i in range(len(PROMPTS))]

    expected = run()
    monkeypatch.setattr(qwen3_moe, "KERNEL_DEVICES", {"cuda", "cpu"})
    got = run()
    for (ids, lps), (want_ids, want_lps) in zip(got, expected, strict=True):
        assert ids == want_ids
        assert lps == pytest.approx(want_lps, abs=1e-4)


def test_fuse_qkv_keeps_values_and_notices_replaced_weights(checkpoint, monkeypatch):
    """`fuse_qkv` re-seats q/k/v as views of one stacked weight (values kept): the fused path (one GEMM, then the
    q/k norm + RoPE + KV-write kernel) gives the torch path's output and KV cache; a projection replaced afterwards
    turns the fused path off instead of computing with the stale copy."""
    import torch

    from freetoken.config import ModelConfig
    from freetoken.models import qwen3_moe
    from freetoken.models.attention import AttentionMetadata

    cfg = ModelConfig.from_dir(checkpoint)
    torch.manual_seed(3)
    attn = qwen3_moe.Attention(cfg)
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight.data = 1 + 0.1 * torch.randn_like(norm.weight)
    x = torch.randn(3, cfg.hidden_size)
    meta = AttentionMetadata.build([3], [3], [[1]], 4, torch.device("cpu"))
    rope = qwen3_moe.RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(meta.positions, x.dtype)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv = tuple(torch.zeros(8, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2))
        return attn(x, rope, kv, meta), *kv

    expected = run()
    attn.fuse_qkv()
    assert attn.q_proj.weight.data_ptr() == attn.qkv[0].data_ptr() and attn._stacked()
    monkeypatch.setattr(qwen3_moe, "KERNEL_DEVICES", {"cuda", "cpu"})
    assert attn._stacked_on(x.device)
    for got, want in zip(run(), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    attn.v_proj.weight = torch.nn.Parameter(2 * attn.v_proj.weight.detach().clone(), requires_grad=False)
    assert not attn._stacked_on(x.device) and attn.qkv is None
    _, k_cache, v_cache = run()
    torch.testing.assert_close(k_cache, expected[1])
    torch.testing.assert_close(v_cache, 2 * expected[2])  # the new v weights, not the stacked copy
