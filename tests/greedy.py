"""Run prompts to completion through an engine, greedily: the shared driver of the equality tests."""

from __future__ import annotations

from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams


def greedy_tokens(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Add every prompt at once (one batch), step until done; the generated token ids per prompt, in order."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].extend(o.chunk.token_ids)
    return [out[str(i)] for i in range(len(prompts))]
