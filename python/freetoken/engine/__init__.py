"""The engine: scheduler, paged KV cache, model runner, sampling, and its asyncio front."""

from freetoken.engine.async_engine import AsyncEngine
from freetoken.engine.llm_engine import LLMEngine, RequestError
from freetoken.engine.types import GenerationChunk, SamplingParams, TokenLogprob

__all__ = ["AsyncEngine", "GenerationChunk", "LLMEngine", "RequestError", "SamplingParams", "TokenLogprob"]
