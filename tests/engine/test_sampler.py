"""`engine.sampler.sample` on hand-made logits: greedy, temperature, top-k, top-p (nucleus) and seeds."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.engine.sampler import LOGPROB_FLOOR, apply_logit_bias, logprobs_of, sample, sample_with_logprobs
from freetoken.engine.types import SamplingParams

NUM_DRAWS = 4000


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def _draws(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [sample(logits, [params], [gen])[0] for _ in range(NUM_DRAWS)]


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 1.0, 1.0, 1.0], [-3.0, -2.0, -1.0, -1.5]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_p=0.1), SamplingParams(top_k=1)]
    assert sample(logits, params, [None, None, None]) == [1, 0, 2]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.5, {0}),  # 0.5 alone reaches 0.5
        (0.51, {0, 1}),
        (0.8, {0, 1}),  # 0.5 + 0.3 reaches 0.8 exactly
        (0.81, {0, 1, 2}),
        (0.95, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (0.01, {0}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    # Token order scrambled so that sorting matters: probs 0.5 (id 2), 0.3 (id 0), 0.15 (id 3), 0.05 (id 1).
    ids = [2, 0, 3, 1]
    logits = _logits([0.3, 0.05, 0.5, 0.15])
    kept_ids = {ids[i] for i in kept}
    draws = _draws(logits, SamplingParams(temperature=1.0, top_p=top_p), seed=int(top_p * 100))
    assert set(draws) == kept_ids
    # Renormalised over the kept set.
    probs = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
    mass = sum(probs[i] for i in kept_ids)
    for token in kept_ids:
        expected = probs[token] / mass
        got = draws.count(token) / NUM_DRAWS
        assert abs(got - expected) < 4 * math.sqrt(expected * (1 - expected) / NUM_DRAWS) + 1e-9, token


@pytest.mark.parametrize("k", [1, 2, 3, 5, 6, 100])
def test_top_k_masks_all_but_k(k):
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.5, -1.0, 0.0]])
    order = [1, 3, 2, 0, 5, 4]
    draws = _draws(logits, SamplingParams(temperature=1.5, top_k=k), seed=k)
    assert set(draws) == set(order[: min(k, 6)])


def test_top_k_then_top_p():
    # top_k=3 leaves ids 1, 3, 2 with renormalised mass ~ 0.57, 0.35, 0.08; top_p=0.9 then drops id 2.
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.5, -1.0, 0.0]])
    draws = _draws(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.9))
    assert set(draws) == {1, 3}


def test_temperature_sharpens_and_flattens():
    logits = _logits([0.6, 0.4])
    cold = _draws(logits, SamplingParams(temperature=0.25)).count(0) / NUM_DRAWS
    warm = _draws(logits, SamplingParams(temperature=1.0)).count(0) / NUM_DRAWS
    hot = _draws(logits, SamplingParams(temperature=2.0)).count(0) / NUM_DRAWS
    expect_cold = 0.6**4 / (0.6**4 + 0.4**4)  # p^(1/T), renormalised
    expect_hot = 0.6**0.5 / (0.6**0.5 + 0.4**0.5)
    assert abs(cold - expect_cold) < 0.03 and abs(warm - 0.6) < 0.03 and abs(hot - expect_hot) < 0.03


def test_never_samples_minus_inf():
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]])
    assert set(_draws(logits, SamplingParams(temperature=2.0))) == {0, 2}


def test_nonfinite_logits_sample_only_what_is_finite():
    """Weights served with NaN (`--allow-nonfinite`): NaN logits are never drawn, +inf takes all the mass, and a
    row of only NaN takes its argmax, as greedy does; none raises (torch.multinomial refuses a NaN distribution)."""
    nan, inf = float("nan"), float("inf")
    assert set(_draws(torch.tensor([[0.0, nan, 0.0, nan]]), SamplingParams(temperature=1.0, top_p=0.9))) == {0, 2}
    assert set(_draws(torch.tensor([[0.0, inf, 1.0]]), SamplingParams(temperature=0.7, top_k=2))) == {1}
    # a row of NaN and -inf has nothing to draw either: its argmax too
    assert set(_draws(torch.tensor([[float("-inf"), nan, float("-inf")]]), SamplingParams(temperature=1.0))) == {1}
    all_nan = torch.full((2, 5), nan)
    gens = [torch.Generator().manual_seed(0), None]
    tokens = sample(all_nan, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)], gens)
    assert tokens == torch.argmax(all_nan, dim=-1).tolist()


def test_nonfinite_logprobs_are_reported_as_the_floor():
    """Log-probabilities of NaN or -inf logits are LOGPROB_FLOOR, not NaN / -inf (which JSON cannot carry)."""
    nan = float("nan")
    logits = torch.tensor([[nan, nan, nan], [0.0, float("-inf"), 0.0]])
    got = logprobs_of(logits, [0, 1], [2, 3])
    assert got[0].logprob == LOGPROB_FLOOR and all(v == LOGPROB_FLOOR for _, v in got[0].top)
    assert got[1].logprob == LOGPROB_FLOOR and got[1].top[0][1] == pytest.approx(math.log(0.5))
    assert got[1].top[2] == (1, LOGPROB_FLOOR)


def test_same_generator_seed_same_tokens_and_rows_independent():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]

    def draw(seeds):
        gens = [torch.Generator().manual_seed(s) if s is not None else None for s in seeds]
        return [sample(logits, params, gens) for _ in range(20)]

    a = draw([7, None, 8])
    assert a == draw([7, None, 8])
    b = draw([7, None, 9])
    assert [x[0] for x in a] == [x[0] for x in b]  # row 0 does not depend on row 2's RNG
    assert [x[2] for x in a] != [x[2] for x in b]
    assert all(x[1] == int(torch.argmax(logits[1])) for x in a)


def test_low_precision_logits():
    logits = _logits([0.1, 0.2, 0.7]).to(torch.bfloat16)
    assert sample(logits, [SamplingParams(temperature=0.0)], [None]) == [2]
    draws = _draws(logits, SamplingParams(temperature=1.0, top_p=0.6))
    assert set(draws) == {2}


def test_top_k_with_ties_keeps_exactly_k():
    # Ties at the k-th value are common with bf16 logits; top_k must still keep k tokens, not every tied one.
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.0, 0.0]])
    draws = _draws(logits, SamplingParams(temperature=1.0, top_k=2))
    assert len(set(draws)) == 2 and set(draws) <= {1, 2, 3, 4}


@pytest.mark.parametrize("temperature", [2.2250738585e-313, 5e-324, 1e-6])
def test_tiny_temperature_is_greedy(temperature):
    # logits / a subnormal temperature overflow to inf (softmax NaN): such temperatures decode as argmax.
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    assert sample(logits, [params], [torch.Generator().manual_seed(0)]) == [1]


def test_logit_bias_moves_sampling_not_logprobs():
    """A bias is added to its token's logit before sampling, greedy rows included, only in its own row; +-100
    forces or bans a token; the log-probabilities stay those of the raw logits, which are not written."""
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [0.1, 3.0, -1.0, 2.9], [5.0, 1.0, 1.0, 1.0]])
    raw = logits.clone()
    params = [
        SamplingParams(temperature=0.0, logit_bias={1: -100}, logprobs=0),  # ban the argmax: the runner-up
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0, logit_bias={2: 100.0, 0: -0.5}),  # forced even when sampling
    ]
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_with_logprobs(logits, params, [None, None, gen])
    assert tokens == [3, 1, 2]
    assert torch.equal(logits, raw)
    want = torch.log_softmax(raw, dim=-1)
    assert logprobs[0].logprob == pytest.approx(want[0, 3].item())
    assert logprobs[1].logprob == pytest.approx(want[1, 1].item())
    assert apply_logit_bias(raw, params[1:2] * 3) is raw  # no bias: no copy
    biased = apply_logit_bias(raw, params)
    assert biased[2].tolist() == pytest.approx([4.5, 1.0, 101.0, 1.0]) and biased[1].tolist() == raw[1].tolist()


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: float("nan")}, {-1: 1.0}, {"1": 1.0}, {1: True}, [1]])
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match=r"^logit_bias"):
        SamplingParams(logit_bias=bias).validate()


def test_penalties_follow_openai_and_ctrl_definitions():
    """presence/frequency as OpenAI defines them (generated tokens only, once / per occurrence), repetition as
    CTRL / Hugging Face (prompt and output, divide positive logits, multiply negative ones); the input is not
    written and rows without penalties are untouched."""
    from freetoken.engine.sampler import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]] * 3)
    tokens = [0, 1, 3, 3, 1, 3]  # prompt [0, 1], then generated 3, 3, 1, 3
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(),
    ]
    out = apply_penalties(logits, params, [tokens] * 3, [2] * 3)
    counts = [0, 1, 0, 3, 0]
    expected0 = [v - 0.5 * c - 0.25 * (c > 0) for v, c in zip([2.0, -1.0, 0.5, 3.0, 1.0], counts, strict=True)]
    assert out[0].tolist() == pytest.approx(expected0)
    assert out[1].tolist() == pytest.approx([1.0, -2.0, 0.5, 1.5, 1.0])  # 0, 1 (prompt) and 3 seen
    assert out[2].tolist() == logits[2].tolist()
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, 1.0]
    assert apply_penalties(logits, [SamplingParams()] * 3, [tokens] * 3, [2] * 3) is logits
    # sampling: greedy picks token 3 raw, token 0 once 3's three repeats cost 1.75
    picked, _ = sample_with_logprobs(
        logits[:1], [SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)], [None], [tokens], [2]
    )
    assert picked == [0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(presence_penalty=2.5),
        SamplingParams(frequency_penalty=-3),
        SamplingParams(repetition_penalty=0),
        SamplingParams(repetition_penalty="x"),
    ],
)
def test_bad_penalties_are_refused(params):
    with pytest.raises(ValueError, match="penalty"):
        params.validate()
