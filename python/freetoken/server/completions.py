"""OpenAI (legacy) text completions: ``POST /v1/completions``, streaming (SSE) and not.

The prompt is raw text, tokenized without a chat template, and the output is raw text (no reasoning
or tool-call parsing). Accepted: ``prompt`` as a string, an array of one string, or an array of token
ids; the sampling and streaming fields of chat completions (`openai.parse_sampling`; ``max_tokens``
defaults to 16, as in the OpenAI API); ``echo`` (the prompt text is prepended to the output);
``logprobs`` (0..20 alternatives; the legacy ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``
object, see `freetoken.server.logprobs`; with ``echo``, the prompt's tokens come first, the first with null
values, as in the OpenAI API: the engine then prefills the whole prompt, as its logits are needed, instead of
reusing cached K/V; ``text_offset`` counts from the start of the choice's text, echo included).
Accepted and ignored: suffix (null only), best_of 1, user. Rejected with 400 (code unsupported):
several prompts, n > 1, suffix, best_of > 1.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.engine.types import MAX_LOGPROBS
from freetoken.server.engine_client import EngineClient
from freetoken.server.errors import ApiError, ErrorCode, invalid_request
from freetoken.server.generation import (
    aclose_shielded,
    check_request,
    closing_chunks,
    collect,
    context_fit,
    fit_context,
    fit_output_budget,
)
from freetoken.server.logprobs import completion_logprobs, joined
from freetoken.server.notices import note_unknown_fields
from freetoken.server.openai import Sampling, error_events, parse_sampling, usage
from freetoken.server.schema import (
    get_field,
    get_int,
    parse_json_object,
    read_body,
    wrong_type,
)
from freetoken.server.sse import (
    OPENAI_DONE,
    EventStreamResponse,
    guard_stream,
    sse_data,
)

# The OpenAI API's default completion budget of this endpoint.
DEFAULT_MAX_TOKENS = 16


def _prompt_ids(body: dict[str, Any], tokenizer: Any) -> tuple[str, list[int]]:
    """``prompt`` -> (its text, its token ids)."""
    prompt = get_field(body, "prompt", (str, list), required=True)
    if isinstance(prompt, str) or (len(prompt) == 1 and isinstance(prompt[0], str)):
        text = prompt if isinstance(prompt, str) else prompt[0]
        ids = tokenizer.encode(text)
        if not ids:
            raise invalid_request(ErrorCode.INVALID_VALUE, "prompt is empty; send some text", "prompt")
        return text, ids
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise invalid_request(
                ErrorCode.INVALID_VALUE, f"prompt holds token id {bad}, outside [0, {tokenizer.vocab_size})", "prompt"
            )
        return tokenizer.decode(prompt), list(prompt)
    if prompt and all(isinstance(p, str | list) for p in prompt):
        raise invalid_request(ErrorCode.UNSUPPORTED, "prompt must be one prompt on this server", "prompt")
    raise wrong_type("prompt", "a string, an array of one string, or a non-empty array of token ids", prompt)


# Top-level fields of a text completions body this server reads, or knows and ignores; any other is logged once.
KNOWN_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "logit_bias",
        "logprobs",
        "echo",
        "suffix",
        "best_of",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "ignore_eos",
        "user",
    }
)


def _sampling(body: dict[str, Any]) -> Sampling:
    get_field(body, "model", str, required=True)
    note_unknown_fields(body, KNOWN_FIELDS, "/v1/completions")
    logprobs = get_int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    if get_field(body, "suffix", str) is not None:
        raise invalid_request(ErrorCode.UNSUPPORTED, "suffix is not supported by this server", "suffix")
    if get_int(body, "best_of", lo=1, default=1) != 1:
        raise invalid_request(ErrorCode.UNSUPPORTED, "best_of must be 1 on this server", "best_of")
    sampling = parse_sampling(body)
    if sampling.n != 1:
        raise invalid_request(ErrorCode.UNSUPPORTED, f"n must be 1 on this endpoint, got {sampling.n}", "n")
    if sampling.max_tokens is None:
        sampling.max_tokens = DEFAULT_MAX_TOKENS
    sampling.params.logprobs = logprobs
    return sampling


async def _stream_events(
    engine: EngineClient,
    prompt_ids: list[int],
    sampling: Sampling,
    echo: str,
    request_id: str,
    created: int,
    model: str,
) -> AsyncGenerator[bytes, None]:
    """The SSE events of one streamed text completion, ending with ``[DONE]``."""
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def chunk_event(text: str, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_data({**base, "choices": [choice]})

    # The echo goes first; with logprobs it waits for the first chunk, which brings the prompt's.
    echo_pending = bool(echo) and sampling.params.prompt_logprobs is not None
    if echo and not echo_pending:
        yield chunk_event(echo)
    chunks = closing_chunks(engine, prompt_ids, sampling.params, request_id)
    last = None
    offset = len(echo)  # text_offset of the next token: the lengths of the texts of the tokens before it
    try:
        async for out in chunks:
            if echo_pending and out.prompt_logprobs is not None:
                echo_pending = False
                prompt_logprobs = completion_logprobs(engine.tokenizer, out.prompt_logprobs, 0, prompt_ids)
                yield chunk_event(echo, logprobs=prompt_logprobs)
            logprobs = None
            if out.logprobs:
                logprobs = completion_logprobs(engine.tokenizer, out.logprobs, offset)
                offset += sum(map(len, logprobs["tokens"]))
            if out.text or logprobs:
                yield chunk_event(out.text, logprobs=logprobs)
            last = out
    finally:
        await aclose_shielded(chunks)
    if last is None or last.finish_reason is None:
        raise ApiError(500, ErrorCode.INTERNAL_ERROR, "the engine ended the request without a finish reason")
    yield chunk_event("", last.finish_reason)
    if sampling.include_usage:
        num_prompt_tokens = last.num_prompt_tokens or len(prompt_ids)
        usage_ = usage(num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
        yield sse_data({**base, "choices": [], "usage": usage_})
    yield OPENAI_DONE


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    state = request.app.state
    engine = state.engine
    body = parse_json_object(await read_body(request))
    sampling = _sampling(body)
    echo = get_field(body, "echo", bool, default=False)
    if echo:
        sampling.params.prompt_logprobs = sampling.params.logprobs
    # Off the event loop: tokenizing (or decoding) a prompt of megabytes takes seconds.
    prompt_text, prompt_ids = await run_in_threadpool(_prompt_ids, body, engine.tokenizer)
    sampling.params.max_tokens = fit_context(
        len(prompt_ids),
        sampling.max_tokens,
        context_fit(state),
        max_tokens_param=sampling.max_tokens_param,
        messages_param="prompt",
    )
    sampling.params.max_tokens = fit_output_budget(
        engine,
        1,
        sampling.params.max_tokens,
        sampling.max_tokens if body.get(sampling.max_tokens_param) is not None else None,  # not the default's
        max_tokens_param=sampling.max_tokens_param,
    )
    check_request(engine, prompt_ids, sampling.params, messages_param="prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = state.served_model_name
    prefix = prompt_text if echo else ""
    if sampling.stream:
        events = _stream_events(engine, prompt_ids, sampling, prefix, request_id, created, model)
        return EventStreamResponse(guard_stream(events, request_id, error_events, keepalive_s=state.keepalive_s))
    [completion] = await collect(request, engine, prompt_ids, [sampling.params], request_id)
    logprobs = None
    if completion.logprobs is not None:
        logprobs = completion_logprobs(engine.tokenizer, completion.logprobs, len(prefix))
        if completion.prompt_logprobs is not None:
            logprobs = joined(
                completion_logprobs(engine.tokenizer, completion.prompt_logprobs, 0, prompt_ids), logprobs
            )
    choice = {
        "index": 0,
        "text": prefix + completion.text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
    }
    return JSONResponse(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [choice],
            "usage": usage(completion.num_prompt_tokens, completion.num_output_tokens, completion.num_cached_tokens),
        }
    )
