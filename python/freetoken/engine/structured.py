"""Structured output: grammar-constrained decoding with llguidance.

A request that must produce JSON (OpenAI ``response_format``, Responses ``text.format``) carries a
`GrammarMatcher` in its `SamplingParams`. Before each sample the sampler asks the matchers of the rows that have
one for the set of tokens the grammar allows next (a bitmask over the vocabulary, computed by llguidance in Rust
with the GIL released), sets every other logit to -inf, and after the sample advances each matcher with its
token. The grammar allows an EOS token only once it is complete, and nothing else after that, so a constrained
request ends exactly when its output is whole (or when it runs out of tokens).

`GrammarBackend` holds the one llguidance tokenizer of the served model (its token trie; built on first use,
about 2 s for Qwen3's 152k tokens) and compiles grammars into matchers. Grammars are Lark text (llguidance's
dialect): `json_grammar` embeds a JSON schema, after an optional reasoning prefix of the model's family, with
the family's tool calls as the alternative to the JSON when tools are offered (the parsers in
`freetoken.server.parsers` write those pieces).

Rows without a matcher cost nothing: `apply_grammar_masks` returns the logits untouched when no row has one.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import llguidance
import torch

from freetoken.errors import FreetokenError
from freetoken.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# JSON compile options forced on every schema. Fixed separators, no free whitespace: with free whitespace a model
# can loop on blank tokens inside an object until it runs out of tokens (vLLM's guided decoding has a switch for
# the same failure); the compact form is also what OpenAI's structured outputs return.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(FreetokenError, ValueError):
    """A grammar or JSON schema llguidance cannot compile; the message says what is wrong."""


def json_expression(schema: dict[str, Any]) -> str:
    """A Lark expression (llguidance's ``%json``) for one JSON value matching `schema`, in this module's compact
    form (an ``x-guidance`` key in the schema is replaced by it)."""
    return f"%json {json.dumps({**schema, 'x-guidance': _JSON_OPTIONS}, ensure_ascii=False)}"


# Keywords whose values are JSON data, not schemas: a "$ref" key inside them is data and stays as it is.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def rebase_refs(schema: Any, base: str) -> tuple[Any, bool]:
    """`schema` with each local reference (a ``$ref`` of ``#`` or ``#/...``, which JSON Schema resolves against the
    root of the document it is in) pointing under `base`, a pointer such as ``#/$defs/tool0``, and whether it had
    any. For a schema embedded in a larger one (a tool's parameters inside the tool-calls grammar), whose root is
    no longer the document's: the caller puts the rebased schema at `base` too. A pydantic model's schema refers
    to its ``#/$defs/...`` this way."""
    if isinstance(schema, list):
        items = [rebase_refs(item, base) for item in schema]
        return [item for item, _ in items], any(found for _, found in items)
    if not isinstance(schema, dict):
        return schema, False
    out: dict[str, Any] = {}
    found = False
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
            found = True
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key], sub = rebase_refs(value, base)
            found = found or sub
    return out, found


def json_grammar(schema: dict[str, Any] | None, reasoning_prefix: str = "", tool_calls: str = "") -> str:
    """A Lark grammar (llguidance's dialect) for one JSON value matching `schema`, or tool calls.

    Args:
        schema: a JSON schema (``{"type": "object"}`` for any object); None for no answer: the output must be
            `tool_calls` (a forced tool call).
        reasoning_prefix: a Lark expression for what may come before the JSON (a model's reasoning block,
            see `OutputParser.reasoning_grammar`), or "".
        tool_calls: a Lark expression for tool calls the model may make instead of answering (see
            `OutputParser.tool_calls_grammar`), or "".

    Returns:
        The grammar text, for `GrammarBackend.matcher`.
    """
    if schema is None:
        return f"start: {reasoning_prefix} reply\nreply: {tool_calls}\n"
    body = f"answer | {tool_calls}" if tool_calls else "answer"
    return f"start: {reasoning_prefix} reply\nreply: {body}\nanswer: {json_expression(schema)}\n"


class GrammarMatcher:
    """The grammar state of one sequence: which tokens may come next, advanced by each sampled token.

    Not thread-safe; owned by one sequence. Use `fork` for another sequence of the same request.
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (one per choice of an ``n > 1`` request)."""
        return GrammarMatcher(self.matcher.deep_copy(), self.eos_token_ids)

    def accept(self, token_id: int) -> None:
        """Advance past `token_id` (a token the mask allowed). A token the grammar refuses puts the matcher in
        its error state, which `apply_grammar_masks` then turns into "EOS only" (logged, never raised: the
        engine step must not fail for one request)."""
        if not self.matcher.consume_token(token_id):
            log.warning("grammar matcher refused token %d: %s", token_id, self.matcher.get_error())

    @property
    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS may come)."""
        return self.matcher.is_accepting()


class GrammarBackend:
    """The served model's llguidance tokenizer, and a factory of matchers over it.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the logits' width (the model's vocabulary, which may be padded past the tokenizer's).
        eos_token_ids: the ids that end generation (the grammar allows them once complete).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer, built on first use (seconds for a 150k vocabulary; call it off the event
        loop). Thread-safe."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._ll_tokenizer

    def matcher(self, grammar: str) -> GrammarMatcher:
        """Compile `grammar` (Lark text, e.g. from `json_grammar`) into a fresh matcher.

        Blocking (the tokenizer on first use, then the grammar: milliseconds, up to a second for huge
        schemas); call it off the event loop.

        Raises:
            GrammarError: the grammar (or the schema inside it) is invalid or uses what llguidance does not
                support; the message is llguidance's.
        """
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarMatcher(matcher, self.eos_token_ids)


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _get_executor() -> llguidance.LLExecutor:
    """One llguidance thread pool for the process (masks of several rows are computed in parallel)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def apply_grammar_masks(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """The logits with every token the row's grammar forbids set to -inf.

    Args:
        logits: [N, V] float logits on the compute device; not written (the raw values stay for logprobs).
        matchers: N entries, a row's matcher or None for an unconstrained row.

    Returns:
        `logits` itself when no row has a matcher; else a new [N, V] tensor, the constrained rows masked. A
        matcher in its error state allows only EOS, so its sequence ends instead of failing the step.
    """
    rows = [row for row, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    num_rows, vocab = len(rows), logits.shape[-1]
    # (k, ceil(V/32)) int32: bit b of word w allows token 32*w + b. Filled on the host while the device may still
    # be computing `logits` (nothing here waits for them until the masked_fill below).
    # (llguidance.torch wraps this call, but importing it imports torch._dynamo: seconds at startup.)
    num_words = (vocab + 31) // 32
    bitmask = torch.empty((num_rows, num_words), dtype=torch.int32)
    constrained = [matchers[row] for row in rows]
    _get_executor().unsafe_compute_mask_ptr(
        [(m.matcher, i) for i, m in enumerate(constrained)], bitmask.data_ptr(), num_words * 4, num_rows
    )
    for i, m in enumerate(constrained):
        if m.matcher.is_error():
            bitmask[i] = 0
            for eos in m.eos_token_ids:
                bitmask[i, eos // 32] |= _bit(eos % 32)
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab].bool()  # (k, V)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_put((index,), masked)


def _bit(position: int) -> int:
    """The int32 word with only bit `position` set (bit 31 is the sign bit)."""
    return -(2**31) if position == 31 else 1 << position


def accept_tokens(matchers: list[GrammarMatcher | None], tokens: list[int]) -> None:
    """Advance each row's matcher (if any) past the token sampled for that row."""
    for matcher, token in zip(matchers, tokens, strict=True):
        if matcher is not None:
            matcher.accept(token)
