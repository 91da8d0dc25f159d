"""Run prompts to completion through an engine, greedily, and through transformers' `generate`: the shared drivers
of the equality tests."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from unittest import mock

import torch

from freetoken.engine import model_runner
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams


def greedy_tokens(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, after_step: Callable[[int], None] | None = None
) -> list[list[int]]:
    """Add every prompt at once (one batch), step until done; the generated token ids per prompt, in order.
    `after_step(i)` runs after the engine's i-th step (a check between steps)."""
    return [[t for t, _ in seq] for seq in _greedy(engine, prompts, max_tokens, False, after_step)]


def greedy_logprobs(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, after_step: Callable[[int], None] | None = None
) -> list[list[tuple[int, float]]]:
    """As `greedy_tokens`, each token with its log-probability."""
    return _greedy(engine, prompts, max_tokens, True, after_step)


def _greedy(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    logprobs: bool,
    after_step: Callable[[int], None] | None,
) -> list[list[tuple[int, float]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0 if logprobs else None)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while engine.has_work():
        for o in engine.step():
            if logprobs:
                out[o.request_id].extend((lp.token_id, lp.logprob) for lp in o.chunk.logprobs)
            else:
                out[o.request_id].extend((t, float("nan")) for t in o.chunk.token_ids)
        if after_step is not None:
            after_step(step)
        step += 1
    return [out[str(i)] for i in range(len(prompts))]


def hf_greedy(model, prompt: list[int], max_tokens: int = 32) -> list[int]:
    """transformers' greedy continuation of `prompt` (exactly `max_tokens` tokens, EOS ignored), on the model's
    device."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return gen[0, len(prompt) :].tolist()


def follows_reference_bf16(
    ref, prompts: list[list[int]], got: list[list[int]], steps: int, label: str, ref32=None
) -> int:
    """How many of `got` (greedy tokens per prompt) equal the reference model's `steps` greedy steps (on its device).

    Both round logits to bfloat16, so where the reference's top two logits are within two bfloat16 steps (a tie at
    that precision) another kernel order may pick the other token: a sequence may part from the reference only at
    such a tie (asserted, naming `label` and the step). With `ref32` (the reference in float32, same device), the tie
    is also as wide as the reference's own bfloat16 error at that step: the largest difference of its bfloat16
    logits from its float32 ones on the same tokens. A recurrent model's bfloat16 rounding builds up in its state
    and a router's top-k turns a small change into another expert, so there the reference's logits are off its
    float32 ones by 0.3-0.6 typically and by 6 at some steps (Qwen3.5's scaled-down test models, CPU, 12 steps),
    far past two ulps; a margin inside that error says nothing about which token is right.
    """
    full = 0
    for prompt, tokens in zip(prompts, got, strict=True):
        ids = torch.tensor([prompt], device=ref.device)
        with torch.no_grad():
            out = ref.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        expected = out.sequences[0, len(prompt) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None)
        if first is None:
            full += 1
            continue
        scores = out.scores[first][0].float()
        top = scores.topk(2).values
        ulp = 2.0 ** (torch.floor(torch.log2(top[0].abs())).item() - 7)  # bfloat16 spacing at that magnitude
        noise = 0.0
        if ref32 is not None:
            prefix = torch.tensor([prompt + expected[:first]], device=ref.device)
            with torch.no_grad():
                logits32 = ref32(prefix).logits[0, -1].float()
            noise = (scores - logits32).abs().max().item()
        assert (top[0] - top[1]).item() <= 2 * ulp + noise, (
            f"{label}: first difference at step {first} where the reference's top-2 margin is "
            f"{(top[0] - top[1]).item()} (> 2 bf16 ulp = {2 * ulp} + its bf16 error there {noise})"
        )
    return full


def forced_logits(engine: LLMEngine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The engine's logits [len(tokens), V] (float32, on the CPU) at each step of decoding `prompt` while the sampler
    is made to pick `tokens` (teacher forcing): the prefill's last row, then one decode step per token, through the
    engine's own prefill and decode paths (CUDA graphs included)."""
    rows: list[torch.Tensor] = []

    def pick(logits, *args):
        rows.append(logits[0].float().cpu())
        return [tokens[len(rows) - 1]], [None]

    params = SamplingParams(max_tokens=len(tokens), temperature=0.0, ignore_eos=True)
    with mock.patch.object(model_runner, "sample_with_logprobs", pick):
        engine.add_request(f"forced-{id(rows)}", prompt, params)
        while engine.has_work():
            engine.step()
    return torch.stack(rows)


def hf_forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), V] (float32, on the CPU) along `prompt` + `tokens`, as `forced_logits`
    gets them: the prompt's prefill, then one cached step per token (its recurrent decode path)."""
    device = model.device
    # transformers renamed the argument (`past_key_values` -> `cache`, 5.x); the device box may hold either.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    rows = []
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
        rows.append(out.logits[0, -1])
        for token in tokens[:-1]:
            out = model(torch.tensor([[token]], device=device), use_cache=True, **{name: out.past_key_values})
            rows.append(out.logits[0, -1])
    return torch.stack(rows).float().cpu()


def bf16_logit_errors(engine: LLMEngine, ref32, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """How far bfloat16 compute lies from exact compute, for the engine and for transformers itself in bfloat16.

    The exact side is the float32 reference with its weights rounded to bfloat16 (the weights both bfloat16 models
    hold), so the figure is the rounding of the computation alone, not of the weights (which swamps it on a small
    random hybrid: a recurrent state at bfloat16 showed as 2% more error against the unrounded weights, 3x against
    these). Along that reference's greedy tokens (teacher-forced: all three see the same inputs), the largest
    |logit error| per step, averaged over steps and prompts. Returns (engine's, transformers').

    A bfloat16 path that rounds where transformers keeps float32 (a gate, a decay, a norm, the recurrent state)
    shows as the engine's figure above transformers'."""
    import copy

    ref_bf16 = copy.deepcopy(ref32).to(torch.bfloat16)
    exact = copy.deepcopy(ref_bf16).to(torch.float32)
    ours, theirs = [], []
    for prompt in prompts:
        tokens = hf_greedy(exact, prompt, steps)
        want = hf_forced_logits(exact, prompt, tokens)
        ours.append((forced_logits(engine, prompt, tokens) - want).abs().amax(-1).mean().item())
        theirs.append((hf_forced_logits(ref_bf16, prompt, tokens) - want).abs().amax(-1).mean().item())
    return sum(ours) / len(ours), sum(theirs) / len(theirs)
