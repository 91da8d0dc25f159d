"""Token log-probabilities (`freetoken.engine.TokenLogprob`) in the OpenAI APIs' shapes.

- Chat completions: ``choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}]}]}``, one entry per generated token (streamed: the entries of the tokens behind each chunk).
- Text completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``;
  with ``echo``, the prompt's tokens first (the first with null values: nothing precedes it).

Values are the model's distribution (float32 log_softmax of the raw logits, before temperature, top-k and top-p;
see `SamplingParams.logprobs`). Every generated token has an entry, the final EOS or stop token included: the
entries match ``usage.completion_tokens``, not the text (which omits a stop token or string).

``token`` is the token's text decoded alone: a piece of a multi-byte character that is not valid UTF-8 by itself
reads as U+FFFD. ``bytes`` are the token's own bytes: for byte-level BPE tokenizers (Qwen's) the raw bytes the
vocabulary maps the token to, so that concatenating the ``bytes`` of consecutive tokens rebuilds the exact UTF-8
text; for added tokens and other tokenizers, the UTF-8 of ``token``.
Log-probabilities below -9999 (and -inf) are reported as -9999.0 (JSON has no infinity), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken.engine.types import TokenLogprob

# The floor of a reported log-probability (JSON cannot hold -inf).
MIN_LOGPROB = -9999.0


def _value(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def _token(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": tokenizer.token_text(token_id),
        "logprob": _value(logprob),
        "bytes": list(tokenizer.token_bytes(token_id)),
    }


def chat_logprobs(tokenizer: Any, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """The chat completions ``logprobs`` object of these tokens."""
    content = []
    for lp in logprobs:
        entry = _token(tokenizer, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_token(tokenizer, token_id, value) for token_id, value in lp.top]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    tokenizer: Any, logprobs: Sequence[TokenLogprob | None], text_offset: int, token_ids: list[int] | None = None
) -> dict[str, Any]:
    """The legacy text completions ``logprobs`` object of these tokens; the first starts at `text_offset` of the
    choice's text (each token's offset adds the lengths of the texts of the tokens before it).

    An entry None (an echoed prompt's first token, which nothing precedes) has null ``token_logprobs`` and
    ``top_logprobs``, as in the OpenAI API; its token is read from `token_ids`, the ids of all the entries, which
    must be given when an entry is None.
    """
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    top: list[dict[str, float] | None] = []
    for i, lp in enumerate(logprobs):
        if lp is not None:
            token_id = lp.token_id
        else:
            assert token_ids is not None, "a None entry needs token_ids"
            token_id = token_ids[i]
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        values.append(_value(lp.logprob) if lp is not None else None)
        top.append({tokenizer.token_text(t): _value(v) for t, v in lp.top} if lp is not None else None)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}


def joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two text completions ``logprobs`` objects as one (an echoed prompt's, then the generated tokens')."""
    return {key: first[key] + second[key] for key in first}
