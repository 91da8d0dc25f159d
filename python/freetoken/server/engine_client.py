"""What the HTTP server needs of an engine: `EngineClient`, the typed seam between `freetoken.server` and
`freetoken.engine.AsyncEngine` (tests pass slow or failing engines that implement the same protocol)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from freetoken.engine.structured import GrammarBackend
from freetoken.engine.types import GenerationChunk, SamplingParams
from freetoken.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the API handlers use it, on the event loop (`freetoken.engine.AsyncEngine` implements it).

    Attributes:
        tokenizer: the model's tokenizer (None when the model directory has none: token-id requests only).
        model_name: the name served in the APIs.
        max_model_len: prompt + output tokens one sequence may hold.
        max_request_output_tokens: the cap on one request's output tokens.
        grammars: the structured-output backend (None when the tokenizer cannot drive one).
    """

    tokenizer: Tokenizer | None
    model_name: str
    max_model_len: int
    max_request_output_tokens: int
    grammars: GrammarBackend | None

    async def start(self) -> None:
        """Start the engine thread (idempotent)."""

    async def shutdown(self) -> None:
        """Abort what runs and stop the engine thread."""

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestError` (naming the field) for what `generate` would refuse."""

    def estimate_prefix_reuse(self, prompt_ids: list[int]) -> tuple[int, int]:
        """(prompt tokens the prefix cache would supply, tokens the request would add to it)."""

    def stats(self) -> dict[str, Any]:
        """The latest engine counters, JSON-able."""

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, group: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Stream one prompt's chunks; the last has a finish_reason; leaving early aborts it."""
