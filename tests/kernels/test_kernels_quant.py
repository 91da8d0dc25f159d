"""The quantized grouped MoE kernels (`freetoken.kernels.fused_moe_quant`) against their torch reference.

Without a GPU, Triton's interpreter (TRITON_INTERPRET=1, set in conftest) runs them on the CPU at small shapes, in
float32 (activations split in two bf16 parts) and in bf16 (the GPU's path), so CI checks the decoding, scale
indexing and masking; a test shows the float32 tolerance fails a swapped nibble order or a shifted scale index. The
`gpu` tests run the real Qwen3-30B-A3B shapes in bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.fused_moe_quant import SCALE_MODES, fused_moe_quant, fused_moe_quant_reference
from freetoken.quant import MXFP4, NVFP4, fp8_block
from freetoken.quant import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [fp8_block(32, 32), fp8_block(), NVFP4, MXFP4]
IDS = ["fp8_32", "fp8_128", "nvfp4", "mxfp4"]


def quantized_slots(
    fmt, num_slots: int, hidden: int, inter: int, seed: int = 0, pad: int = 192, align: int = 256
) -> torch.Tensor:
    """[S, stride] uint8 slots of reference-quantized N(0, 0.05) experts: stride = expert_nbytes + pad rounded up to
    `align` bytes (256: the pool's and the slot cache's EXPERT_ALIGN spacing; 1: packed, as a misaligned caller)."""
    gen = torch.Generator().manual_seed(seed)
    layout = fmt.layout(hidden, inter)
    stride = -(-(layout.expert_nbytes + pad) // align) * align
    slots = torch.zeros(num_slots, stride, dtype=torch.uint8)
    for s in range(num_slots):
        gate, up, down = (
            torch.randn(r, c, generator=gen) * 0.05 for r, c in ((inter, hidden),) * 2 + ((hidden, inter),)
        )
        ref.pack_expert(
            layout, *(ref.quantize_matrix(fmt, w) for w in (gate, up, down)), out=slots[s, : layout.expert_nbytes]
        )
    return slots


def _case(
    fmt,
    num_tokens: int,
    top_k: int,
    hidden: int,
    inter: int,
    num_slots: int,
    dtype: torch.dtype,
    corrupt=None,
    scale_mode: str | None = None,
    kernel: str | None = None,
    align: int = 256,
    pad: int = 192,
    gemv_configs=None,
):
    """(kernel output, reference output) float32 [M, hidden]; `corrupt(slots, layout)` edits the bytes the reference
    reads (not the kernel's), standing in for a kernel that decodes them wrong."""
    gen = torch.Generator().manual_seed(num_tokens)
    slots = quantized_slots(fmt, num_slots, hidden, inter, pad=pad, align=align).to(DEVICE)
    ids = torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[0, -1] = -1  # a pair computed elsewhere
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)
    hidden_states = torch.randn(num_tokens, hidden, generator=gen)
    layout = fmt.layout(hidden, inter)
    got = fused_moe_quant(
        hidden_states.to(DEVICE, dtype),
        slots,
        layout,
        ids.to(DEVICE),
        weights.to(DEVICE, dtype),
        scale_mode=scale_mode,
        kernel=kernel,
        gemv_configs=gemv_configs,
    )
    if corrupt is not None:
        slots = corrupt(slots.clone(), layout)
    want = fused_moe_quant_reference(hidden_states.to(DEVICE), slots, layout, ids.to(DEVICE), weights.to(DEVICE))
    return got.float(), want


def _small_sizes(fmt) -> tuple[int, int]:
    return (256, 128) if fmt.block_rows == 128 else (128, 64)


# float32 activations: the kernels dot two bf16 parts of each activation (hi + lo, 16 significant bits) against
# weights decoded exactly, accumulating in float32; measured <= 6e-7 of the largest output at these sizes.
F32_TOL = 1e-5


# (format, scale mode) cases: FP8 has one way to apply its scale, the 4-bit formats each of `SCALE_MODES`
MODE_CASES = [(fmt, None) for fmt in FORMATS[:2]] + [(fmt, m) for fmt in (NVFP4, MXFP4) for m in SCALE_MODES]
MODE_IDS = IDS[:2] + [f"{name}-{m}" for name in ("nvfp4", "mxfp4") for m in SCALE_MODES]


@pytest.mark.parametrize(("fmt", "scale_mode"), MODE_CASES, ids=MODE_IDS)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 4), (5, 2)])
def test_quant_kernel_matches_reference_small(fmt, scale_mode, num_tokens, top_k):
    """float32 (the interpreter on the CPU), the tensor-core kernels: `F32_TOL` of the largest output (bf16 hi + lo
    activation parts, float32 sums in another order than torch's)."""
    got, want = _case(fmt, num_tokens, top_k, *_small_sizes(fmt), 6, torch.float32, scale_mode=scale_mode, kernel="mma")
    torch.testing.assert_close(got, want, atol=F32_TOL * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 4), (5, 2)])
def test_gemv_kernel_matches_reference_small(fmt, num_tokens, top_k):
    """float32, the CUDA-core kernels (`fused_moe_gemv`, float32 products of exactly decoded weights, group sums
    scaled once): `F32_TOL` of the largest output; five tokens put several rows in one expert's tile."""
    got, want = _case(fmt, num_tokens, top_k, *_small_sizes(fmt), 6, torch.float32, kernel="gemv")
    torch.testing.assert_close(got, want, atol=F32_TOL * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_gemv_prefetch_two_steps_matches_reference_small(fmt):
    """The gemv kernels loading two K steps ahead (`fused_moe_gemv.GemvConfig`'s last field), with narrow steps
    so the dots run over 2-8 of them and the loads ahead run past the end of each matrix (masked): `F32_TOL` of the
    largest output."""
    config = (4, 32, 1, 2)
    got, want = _case(fmt, 5, 2, *_small_sizes(fmt), 6, torch.float32, kernel="gemv", gemv_configs=(config, config))
    torch.testing.assert_close(got, want, atol=F32_TOL * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt", [NVFP4, fp8_block()], ids=["nvfp4", "fp8_128"])
def test_decode_batches_take_gemv_where_aligned(fmt, monkeypatch):
    """Left to choose, a decode-sized call runs the gemv kernels on aligned slots and the tensor-core kernels on
    slots packed at expert_nbytes (64-bit words would be misaligned), each matching the reference."""
    from freetoken.kernels import fused_moe_gemv, fused_moe_quant

    calls: list[str] = []
    gemv_tiles = fused_moe_gemv.gemv_tiles
    monkeypatch.setattr(fused_moe_quant, "gemv_tiles", lambda *a, **k: calls.append("gemv") or gemv_tiles(*a, **k))
    for align, expected in ((256, ["gemv"]), (1, [])):
        calls.clear()
        got, want = _case(fmt, 1, 4, *_small_sizes(fmt), 6, torch.float32, align=align, pad=3)
        assert calls == expected
        torch.testing.assert_close(got, want, atol=F32_TOL * want.abs().max().item(), rtol=0)


def test_fp4_mma_refuses_what_it_cannot_run():
    """The fp4_mma kernels (Gluon, mma.sync) run NVFP4 / MXFP4 on CUDA with bf16 activations and whole K steps per
    warp slice: anything else is refused with a ValueError before a launch, not run wrong."""
    from freetoken.kernels import fused_moe_fp4_mma

    assert fused_moe_fp4_mma.fits((4, 4, 1, 0), 2048) and fused_moe_fp4_mma.fits((4, 2, 2, 0), 768)
    assert not fused_moe_fp4_mma.fits((4, 4, 1, 0), 768) and not fused_moe_fp4_mma.fits((8, 2, 1, 0), 768)
    fmt = NVFP4
    slots = quantized_slots(fmt, 2, *_small_sizes(fmt))
    args = (fmt.layout(*_small_sizes(fmt)), torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp4_mma"):
            fused_moe_quant(torch.randn(1, _small_sizes(fmt)[0], dtype=torch.bfloat16), slots, *args, kernel="fp4_mma")
    with pytest.raises(ValueError, match="fp4_mma"):
        fused_moe_quant(torch.randn(1, 256), quantized_slots(fp8_block(), 2, 256, 128), fp8_block().layout(256, 128),
                        *args[1:], kernel="fp4_mma")  # fmt: skip


def test_fp4_mma_default_configs_by_batch():
    """Left to choose, the fp4_mma kernels run one token of top-8 (up to SMALL_UP_TO_PAIRS pairs) with the loops
    unrolled and down's K split over programs where that fits the sizes, keep one K step of loads ahead in
    registers for other small decode batches, and copy every K step into shared memory up front from
    STAGED_FROM_PAIRS pairs on (batch 8 of top-8)."""
    from freetoken.kernels import fused_moe_fp4_mma as m

    qwen3 = (2048, 768)  # Qwen3-30B-A3B's hidden and expert intermediate sizes
    assert m.default_configs(1, *qwen3) == m.default_configs(m.SMALL_UP_TO_PAIRS, *qwen3) == m.FP4_MMA_SMALL_CONFIGS
    assert m.default_configs(m.SMALL_UP_TO_PAIRS + 1, *qwen3) == m.FP4_MMA_CONFIGS
    assert m.default_configs(m.STAGED_FROM_PAIRS - 1, *qwen3) == m.FP4_MMA_CONFIGS
    assert m.default_configs(m.STAGED_FROM_PAIRS, *qwen3) == m.default_configs(64, *qwen3) == m.FP4_MMA_STAGED_CONFIGS
    # an intermediate size down's 3 splits of whole K steps do not divide: the unsplit configs
    assert m.default_configs(8, 1024, 512) == m.FP4_MMA_CONFIGS
    assert all(config.prefetch == 0 for config in m.FP4_MMA_STAGED_CONFIGS)  # staged
    assert all(config.prefetch > 0 for config in m.FP4_MMA_CONFIGS + m.FP4_MMA_SMALL_CONFIGS)
    assert m.FP4_MMA_SMALL_CONFIGS[1].split == 3 and m.FP4_MMA_SMALL_CONFIGS[0].split == 1


def test_fp4_mma_configs_take_tuples_and_refuse_what_does_not_fit():
    """Configs given as plain tuples take the later fields' defaults; a split gate/up (SwiGLU needs whole sums), a
    split that leaves a program part of a K step and K steps that leave a lane part of a scale block are refused
    with the config and the sizes in the message."""
    from freetoken.kernels import fused_moe_fp4_mma as m

    gate_up, down = m.configs_for(((4, 2, 1, 80), (4, 1, 1, 80, 1, 3)), 8, 2048, 768)
    assert gate_up == m.Fp4MmaConfig(4, 2, 1, 80, 0, 1) and (down.unroll, down.split) == (1, 3)
    assert m.configs_for(None, 8, 2048, 768) == m.default_configs(8, 2048, 768)
    assert m.fits((4, 1, 1, 0, 0, 6), 768) and not m.fits((4, 1, 1, 0, 0, 4), 768)
    # K steps of fewer than 4 units, or not a power of two, leave a lane part of a scale block
    assert m.fits((8, 1, 1, 0), 768) and not m.fits((2, 1, 1, 0), 768) and not m.fits((6, 1, 1, 0), 768)
    with pytest.raises(ValueError, match="gate/up"):
        m.configs_for(((4, 2, 1, 80, 0, 2), (4, 1, 1, 80)), 8, 2048, 768)
    with pytest.raises(ValueError, match="768 columns"):
        m.configs_for(((4, 2, 1, 80), (4, 1, 1, 80, 0, 4)), 8, 2048, 768)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 3, 40, 64])
@pytest.mark.parametrize(
    ("interleaved", "pdl"), [(True, True), (False, True), (True, False)], ids=["interleaved", "contiguous", "no-pdl"]
)
def test_fp4_mma_matches_gemv_other_shapes_and_configs(fmt, num_tokens, interleaved, pdl, monkeypatch):
    """fp4_mma at another model's shapes (H 1024, I 512) and configs that fit them (K steps of 128 or 256
    columns, 1-4 warp slices, loads 1 or 2 steps ahead or all up front in shared memory, register caps or none, the
    K loop unrolled by two, down's K split over 2 or 4 programs, the warps' K slices interleaved or contiguous, the
    down kernel a programmatic dependent launch or not), against the
    reference at the bf16 tolerance; 40 and 64 tokens put more than 8 rows in tiles (a second token group, partly or
    wholly real). Loads all up front add the same products in the same order as loads two steps ahead: equal bit for
    bit."""
    from freetoken.kernels import fused_moe_fp4_mma
    from freetoken.kernels.fused_moe_fp4_mma import fits

    monkeypatch.setattr(fused_moe_fp4_mma, "INTERLEAVED_SLICES", interleaved)
    monkeypatch.setattr(fused_moe_fp4_mma, "PROGRAMMATIC_LAUNCH", pdl)
    gen = torch.Generator().manual_seed(num_tokens)
    slots = quantized_slots(fmt, 16, 1024, 512).cuda()
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(num_tokens)]).cuda()
    weights = torch.softmax(torch.randn(num_tokens, 4, generator=gen), dim=-1).cuda()
    x = torch.randn(num_tokens, 1024, generator=gen).cuda()
    layout = fmt.layout(1024, 512)
    want = fused_moe_quant_reference(x, slots, layout, ids, weights)
    got = {}
    for gate_up in [(4, 1, 1, 0), (4, 2, 2, 168), (8, 4, 1, 0), (4, 2, 0, 0), (4, 2, 1, 128, 1), (4, 1, 1, 128, 1)]:
        for down in [(4, 1, 2, 0), (8, 2, 1, 128), (4, 1, 0, 0), (4, 1, 1, 80, 1, 2), (4, 1, 1, 0, 0, 4)]:
            assert fits(gate_up, 1024) and fits(down, 512)
            got[gate_up, down] = fused_moe_quant(
                x.bfloat16(), slots, layout, ids, weights.bfloat16(), kernel="fp4_mma", fp4_mma_configs=(gate_up, down)
            ).float()
            torch.testing.assert_close(got[gate_up, down], want, atol=2e-2 * want.abs().max().item(), rtol=0)
    assert torch.equal(got[(4, 2, 0, 0), (4, 1, 0, 0)], got[(4, 2, 2, 168), (4, 1, 2, 0)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 2])
def test_fp4_mma_one_token_configs_match_the_reference(fmt, num_tokens):
    """At Qwen3-30B-A3B's sizes (H 2048, I 768, top-8), a token's call takes FP4_MMA_SMALL_CONFIGS (down split over
    3 programs, summed by `sum_pairs`), two tokens FP4_MMA_CONFIGS: both against the reference at the bf16
    tolerance, and the small configs against the unsplit ones within a bf16 rounding of each of the three shares."""
    from freetoken.kernels import fused_moe_fp4_mma as m

    gen = torch.Generator().manual_seed(num_tokens)
    slots = quantized_slots(fmt, 16, 2048, 768).cuda()
    layout = fmt.layout(2048, 768)
    ids = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(num_tokens)]).cuda()
    weights = torch.softmax(torch.randn(num_tokens, 8, generator=gen), dim=-1).bfloat16().cuda()
    x = torch.randn(num_tokens, 2048, generator=gen).bfloat16().cuda()
    want = fused_moe_quant_reference(x.float(), slots, layout, ids, weights.float())
    got = fused_moe_quant(x, slots, layout, ids, weights, kernel="fp4_mma").float()
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)
    unsplit = fused_moe_quant(x, slots, layout, ids, weights, kernel="fp4_mma", fp4_mma_configs=m.FP4_MMA_CONFIGS)
    torch.testing.assert_close(got, unsplit.float(), atol=2e-2 * want.abs().max().item(), rtol=0)
    if num_tokens == 1:
        assert not torch.equal(got, unsplit.float())  # the split ran: its shares round on their own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
def test_fp4_mma_in_a_cuda_graph_matches_eager(fmt):
    """The fp4_mma kernels captured in a CUDA graph (the engine's decode graphs; the down kernel's programmatic
    dependence on gate/up becomes a graph edge) give the eager call's output bit for bit, replayed after the
    inputs change in place."""
    gen = torch.Generator().manual_seed(0)
    slots = quantized_slots(fmt, 16, 1024, 512).cuda()
    layout = fmt.layout(1024, 512)
    ids = torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(2)]).cuda()
    weights = torch.softmax(torch.randn(2, 4, generator=gen), dim=-1).bfloat16().cuda()
    x = torch.randn(2, 1024, generator=gen).bfloat16().cuda()

    def call():
        return fused_moe_quant(x, slots, layout, ids, weights, kernel="fp4_mma")

    call()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(2, 1024, generator=gen).bfloat16())
        ids.copy_(torch.stack([torch.randperm(16, generator=gen)[:4] for _ in range(2)]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call())


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_scale_modes_agree_bit_for_bit(fmt, dtype):
    """Every scale mode hands the dots the same bf16 weights up to a power of two that the accumulator gets back
    exactly, so the outputs are equal bit for bit, not only within tolerance. The tensor-core kernels ("mma"),
    whose scale modes these are (the default at 10 pairs, gemv, applies scales one way)."""
    outs = [_case(fmt, 5, 2, *_small_sizes(fmt), 6, dtype, scale_mode=m, kernel="mma")[0] for m in SCALE_MODES]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize(("fmt", "scale_mode"), MODE_CASES, ids=MODE_IDS)
def test_quant_kernel_bf16_small(fmt, scale_mode):
    """bf16 activations, the path GPUs run (one bf16 dot per weight tile, no activation split), on the CPU: the
    reference is float32 from unrounded inputs while the kernel rounds its inputs, the GEMM outputs, SiLU and h to
    bf16 as the bf16 kernel does; measured <= 2.7e-2 of the largest output at these small sizes (the previous
    float32-dot kernel gave the same errors): 4e-2. A wrong nibble order or scale is off by the output's size."""
    got, want = _case(fmt, 5, 2, *_small_sizes(fmt), 6, torch.bfloat16, scale_mode=scale_mode, kernel="mma")
    torch.testing.assert_close(got, want, atol=4e-2 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_gemv_kernel_bf16_small(fmt):
    """bf16 activations through the gemv kernels: rounded where the tensor-core kernels round (the GEMM outputs,
    SiLU, h), the same 4e-2 of the largest output."""
    got, want = _case(fmt, 5, 2, *_small_sizes(fmt), 6, torch.bfloat16, kernel="gemv")
    torch.testing.assert_close(got, want, atol=4e-2 * want.abs().max().item(), rtol=0)


def _swap_nibbles(slots: torch.Tensor, layout) -> torch.Tensor:
    off, nbytes = layout.sections["gate_up"]
    part = slots[:, off : off + nbytes]
    slots[:, off : off + nbytes] = (part >> 4) | (part << 4)
    return slots


def _shift_scales(slots: torch.Tensor, layout) -> torch.Tensor:
    """Each row's block scales moved one block along K (a scale index off by one block column)."""
    fmt = layout.format
    off, nbytes = layout.sections["down_scale"]
    rows, cols = fmt.scale_shape(layout.hidden, layout.inter)
    scales = slots[:, off : off + nbytes].reshape(slots.shape[0], rows, cols * fmt.scale_bytes)
    slots[:, off : off + nbytes] = scales.roll(fmt.scale_bytes, dims=2).reshape(slots.shape[0], -1)
    return slots


@pytest.mark.parametrize(
    ("fmt", "corrupt"),
    [(NVFP4, _swap_nibbles), (MXFP4, _swap_nibbles), (NVFP4, _shift_scales), (MXFP4, _shift_scales)],
    ids=["nvfp4-nibbles", "mxfp4-nibbles", "nvfp4-scales", "mxfp4-scales"],
)
@pytest.mark.parametrize("kernel", ["mma", "gemv"])
def test_tolerance_catches_wrong_decoding(fmt, corrupt, kernel):
    """The float32 tolerance is far below what a swapped nibble order or a scale index off by one block costs:
    against a reference that decodes the bytes that way, each kernel is off by more than 100x `F32_TOL`."""
    got, want = _case(fmt, 5, 2, *_small_sizes(fmt), 6, torch.float32, corrupt=corrupt, kernel=kernel)
    assert (got - want).abs().max().item() > 100 * F32_TOL * want.abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("fmt", "scale_mode"), MODE_CASES[1:], ids=MODE_IDS[1:])
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 8), (4, 8), (64, 8), (512, 8)])
@pytest.mark.parametrize("kernel", ["mma", "gemv", "fp4_mma"])
def test_quant_kernel_matches_reference_qwen3_30b_shapes(fmt, scale_mode, num_tokens, top_k, kernel):
    """bf16 activations at Qwen3-30B-A3B's shapes (H 2048, I 768), decode batch 1-64 and a 512-token prefill
    chunk (the tensor-core kernels only), each kernel; bf16 rounding of the GEMM outputs as the bf16 kernel: 2e-2
    of the largest output."""
    if kernel in ("gemv", "fp4_mma") and (num_tokens > 64 or scale_mode not in (None, "bf16")):
        pytest.skip("the gemv and fp4_mma kernels run decode batches and have one way to apply scales")
    if kernel == "fp4_mma" and fmt.weight_bits != 4:
        pytest.skip("the fp4_mma kernels run the 4-bit formats")
    got, want = _case(fmt, num_tokens, top_k, 2048, 768, 32, torch.bfloat16, scale_mode=scale_mode, kernel=kernel)
    torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_scale_modes_agree_bit_for_bit_qwen3_30b_shapes(fmt, num_tokens):
    """The scale modes' outputs are equal bit for bit on the GPU too: the "bf16" mode's packed bf16 multiply
    (HMUL2.BF16) keeps its subnormal operands (the e2m1 0.5 codes, 0.5 * 2^-126), which the tolerance above could
    miss. The tensor-core kernels ("mma"), whose scale modes these are: at decode sizes the default kernels apply
    scales one way."""
    outs = [
        _case(fmt, num_tokens, 8, 2048, 768, 32, torch.bfloat16, scale_mode=m, kernel="mma")[0] for m in SCALE_MODES
    ]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
