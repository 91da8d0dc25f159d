"""A request inside the engine: its tokens, how many have KV in the cache, its blocks and its output state."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from freetoken.engine.stop import OutputText
from freetoken.engine.types import FinishReason, SamplingParams, TokenLogprob

_arrival = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request.

    Prefill and decode are one mechanism: each step computes the tokens of `token_ids[num_computed:]` (all of
    them, or a chunk of a long prompt), and a token is sampled when that reaches the end.

    Attributes:
        request_id: the caller's id.
        prompt_len: tokens in the prompt.
        token_ids: prompt then generated tokens.
        params: sampling parameters.
        num_computed: leading tokens whose K/V are in the cache.
        block_table: KV block ids, in order.
        state_slot: its slot in the recurrent-state pool while running (hybrid models), else -1.
        num_hashed_blocks: leading full blocks whose content the prefix cache knows (found there at admission, or
            indexed after the step that filled them); `kv_parent` is the index node of the last of them
            (`prefix_cache.ROOT` when none), the parent of the next block's key; `kv_nodes` the node of each of
            those blocks, in order (state checkpoints key a snapshot by the node of its last full block).
        num_cached_tokens: prompt tokens whose K/V came from the prefix cache at the first admission (None until
            then); `num_cache_write_tokens`: prompt tokens in full blocks this sequence computes itself, which
            the cache keeps for later requests (0 with the prefix cache off).
        prompt_logprobs: with `SamplingParams.prompt_logprobs`, the prompt tokens' log-probabilities computed so
            far (None for token 0; `ModelRunner` appends as prompt chunks run), handed out with the first output
            token; else None.
        generator: this request's RNG (sampling), None when greedy.
        text: incremental detokenization and stop-string matching, None without a tokenizer.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    text: OutputText | None
    prompt_len: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int = -1
    num_hashed_blocks: int = 0
    kv_parent: int = 0
    kv_nodes: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None
    num_cache_write_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))

    def __post_init__(self) -> None:
        self.prompt_len = len(self.token_ids)

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next sample (1 while decoding)."""
        return len(self.token_ids) - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prompt's log-probabilities are still to be computed (asked for, and no token sampled yet:
        a sequence preempted before its first token computes them again from the start)."""
        return self.params.prompt_logprobs is not None and self.num_output == 0

    @property
    def finished(self) -> bool:
        """Whether the sequence has a finish reason (stop, length or abort)."""
        return self.finish_reason is not None
