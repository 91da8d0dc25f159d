"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2020), per-request seeds,
repetition penalties and logit biases; grammar-constrained rows (`SamplingParams.grammar`, see
`freetoken.engine.structured`); the sampled tokens' log-probabilities for requests that ask (`token_logprobs`)."""

from __future__ import annotations

import torch

from freetoken.engine.structured import accept_tokens, apply_grammar_masks
from freetoken.engine.types import SamplingParams, TokenLogprob


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [N, V] float32 logits on the compute device.
        params: N sampling parameter sets, row by row.
        generators: N RNGs on the logits' device (None for greedy rows).

    Returns:
        N token ids. NaN logits (weights served with NaN, `--allow-nonfinite`) are never sampled, a row holding
        +inf samples among its +inf tokens, and a row left with none to sample (all NaN) takes its argmax, as greedy
        does (`_drawable`).
    """
    greedy_ids = torch.argmax(logits, dim=-1)
    # one transfer for the greedy tokens and whether every logit is finite (not so only for weights served with NaN
    # or inf, `--allow-nonfinite`): the common path pays one reduction, not a cleanup of every row
    head = torch.cat([greedy_ids, torch.isfinite(logits).all().long()[None]]).tolist()
    greedy, finite = head[:-1], bool(head[-1])
    if not finite and not all(p.greedy for p in params):
        logits = _drawable(logits, greedy_ids)
    out: list[int] = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            out.append(greedy[row])
            continue
        scores = logits[row] / p.temperature
        if p.top_k > 0 and p.top_k < scores.numel():
            # Keep exactly top_k ids (by index, not `>= k-th value`: ties, common in bf16 logits, would keep more).
            keep = torch.topk(scores, p.top_k).indices
            scores = torch.full_like(scores, float("-inf")).scatter(0, keep, scores[keep])
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token when the mass before it already reaches top_p; the first token always stays.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out


def _drawable(logits: torch.Tensor, greedy_ids: torch.Tensor) -> torch.Tensor:
    """[N, V] logits that are not all finite -> ones softmax can draw from (a NaN or +inf score makes softmax NaN
    everywhere, which torch.multinomial refuses: a device assert on CUDA): NaN never drawn, a row holding +inf draws
    among its +inf tokens alone, and a row left with none (all NaN or -inf) its greedy token (`greedy_ids` [N])."""
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    pos = torch.isposinf(logits)
    clean = torch.where(pos, 0.0, torch.nan_to_num(logits, nan=float("-inf"), neginf=float("-inf")))
    clean = torch.where(pos.any(dim=-1, keepdim=True) & ~pos, minus_inf, clean)
    lone = torch.full_like(clean, float("-inf")).scatter(1, greedy_ids[:, None], 0.0)
    return torch.where(torch.isneginf(clean).all(dim=-1, keepdim=True), lone, clean)


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenLogprob | None]:
    """The log-probabilities of the sampled `tokens`, for the rows whose params ask for them (`logprobs`).

    They are those of the model's distribution: log_softmax of the raw logits in float32, before temperature,
    top-k and top-p (what vLLM and the OpenAI API report). Rows that did not ask cost nothing; the rows that did
    take one log_softmax, one gather and one batched topk (k = the largest ask) over just those rows
    (`logprobs_of`).

    Args:
        logits: [N, V] logits (any float dtype; computed in float32).
        params: N sampling parameter sets.
        tokens: the N sampled token ids.

    Returns:
        Per row, a `TokenLogprob` with `params[row].logprobs` alternatives, or None for a row that did not ask.
    """
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return out
    if len(rows) == len(params):
        picked = logits
    else:
        picked = logits[torch.tensor(rows, device=logits.device)]
    found = logprobs_of(picked, [tokens[row] for row in rows], [params[row].logprobs or 0 for row in rows])
    for row, entry in zip(rows, found, strict=True):
        out[row] = entry
    return out


# the log-probability reported for a token of no probability (OpenAI's API reports -9999.0 for those)
LOGPROB_FLOOR = -9999.0


def logprobs_of(logits: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Row i's `TokenLogprob` of `tokens[i]` with its `num_top[i]` most likely alternatives: log_softmax of the
    raw logits in float32, one gather and one batched topk (k = the largest `num_top`).

    Args:
        logits: [M, V] logits (any float dtype).
        tokens: M token ids, each < V.
        num_top: M counts of alternatives, each >= 0.

    Log-probabilities that are not finite (NaN or inf logits) are reported as LOGPROB_FLOOR.
    """
    # NaN or -inf (weights served with NaN or inf, --allow-nonfinite) become LOGPROB_FLOOR: JSON holds neither
    logprobs = torch.nan_to_num(torch.log_softmax(logits.float(), dim=-1), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
    ids = torch.tensor(tokens, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    k = min(max(num_top), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in tokens]
    top_ids: list[list[int]] = [[] for _ in tokens]
    if k > 0:
        values, indices = torch.topk(logprobs, k, dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    return [
        TokenLogprob(token, chosen[i], list(zip(top_ids[i][:n], top_values[i][:n], strict=True)))
        for i, (token, n) in enumerate(zip(tokens, num_top, strict=True))
    ]


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`logits` with each row's `SamplingParams.logit_bias` added: a new tensor when any row has one (the input is
    not written: log-probabilities come from it), else `logits` itself.

    Args:
        logits: [N, V] float logits.
        params: N sampling parameter sets (biased token ids already checked to be < V).
    """
    rows = [(row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    device = logits.device
    row_ids = torch.tensor([row for row, bias in rows for _ in bias], device=device)
    token_ids = torch.tensor([token for _, bias in rows for token in bias], device=device)
    values = torch.tensor([value for _, bias in rows for value in bias.values()], dtype=logits.dtype, device=device)
    return logits.index_put((row_ids, token_ids), values, accumulate=True)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]], prompt_lens: list[int]
) -> torch.Tensor:
    """`logits` with each row's repetition penalties applied: a new tensor when any row has one (the input is not
    written), else `logits` itself.

    In this order, as vLLM does: `repetition_penalty` r (CTRL, Keskar et al. 2019, as Hugging Face's
    RepetitionPenaltyLogitsProcessor): each token in the prompt or the output gets logit / r when the logit is
    positive, logit * r otherwise; then OpenAI's ``logit - frequency_penalty * count - presence_penalty *
    (count > 0)``, count being how often the token was generated (the prompt does not count).

    Args:
        logits: [N, V] float logits.
        params: N sampling parameter sets.
        token_ids: per row, the sequence's prompt then generated tokens (ids < V).
        prompt_lens: per row, how many of `token_ids` are the prompt.
    """
    rows = [row for row, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    out = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    for row in rows:
        p = params[row]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(token_ids[row])), dtype=torch.int64, device=device)
            values = out[row, seen]
            out[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        generated = token_ids[row][prompt_lens[row] :]
        if generated and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(generated, dtype=torch.int64, device=device), minlength=vocab)
            counts = counts[:vocab].to(out.dtype)
            out[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def sample_with_logprobs(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    token_ids: list[list[int]] | None = None,
    prompt_lens: list[int] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """`sample`, plus `token_logprobs` of the sampled tokens for the rows that ask (None for the others).

    Rows with repetition penalties sample from penalized logits (`apply_penalties`, which needs `token_ids` and
    `prompt_lens`); rows with a `logit_bias` from their biased logits (`apply_logit_bias`); rows with a `grammar`
    from their masked logits (only the tokens the grammar allows, after any bias), and their matchers advance past
    the sampled tokens; log-probabilities stay those of the raw logits. Without any bias or grammar in the batch
    this is `sample` on the raw logits, at no extra cost.

    Args:
        logits: [N, V] float32 logits on the compute device; not written.
        params: N sampling parameter sets, row by row.
        generators: N RNGs on the logits' device (None for greedy rows).
        token_ids: per row, the sequence's tokens so far (prompt then output); needed when a row is penalized.
        prompt_lens: per row, the prompt's length in `token_ids`.
    """
    scores = logits
    if token_ids is not None and prompt_lens is not None:
        scores = apply_penalties(logits, params, token_ids, prompt_lens)
    scores = apply_logit_bias(scores, params)
    matchers = [p.grammar for p in params]
    if any(m is not None for m in matchers):
        tokens = sample(apply_grammar_masks(scores, matchers), params, generators)
        accept_tokens(matchers, tokens)
    else:
        tokens = sample(scores, params, generators)
    return tokens, token_logprobs(logits, params, tokens)
