"""Request-level types shared by the engine and the server: sampling parameters and streamed output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from freetoken.engine.structured import GrammarMatcher

FinishReason = Literal["stop", "length", "abort"]

# Temperatures below this decode greedily (vLLM's sampling epsilon): logits / 1e-313 are inf, whose softmax is NaN.
MIN_TEMPERATURE = 1e-5
# Most top alternatives per token a request may ask for (`SamplingParams.logprobs`), as in the OpenAI API.
MAX_LOGPROBS = 20
# Largest |bias| per token (`SamplingParams.logit_bias`), as in the OpenAI API.
MAX_LOGIT_BIAS = 100
# Largest `SamplingParams.repetition_penalty` (vLLM allows any positive value; past 2 text degrades anyway).
MAX_REPETITION_PENALTY = 10.0


@dataclass
class SamplingParams:
    """How one request is decoded.

    Attributes:
        max_tokens: most new tokens to generate (>= 1).
        temperature: softmax temperature; 0 means greedy (argmax), and so does any value below
            `MIN_TEMPERATURE` (dividing the logits by a subnormal one overflows them to inf).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: per-request RNG seed; the same seed and prompt give the same tokens.
        stop: strings that end generation; the matched string is not part of the output text.
        stop_token_ids: token ids that end generation besides the model's EOS ids.
        ignore_eos: keep going past EOS (benchmarks).
        logprobs: None (the default) reports no log-probabilities; 0..20 reports, for every generated token,
            its log-probability and that many most likely alternatives (`TokenLogprob`). They are those of the
            model's own distribution: log_softmax of the raw logits in float32, before temperature, top-k and
            top-p (as vLLM and the OpenAI API report them), so they do not depend on the sampling settings.
            With a `grammar` too, they are still the unconstrained model's.
        prompt_logprobs: None (the default), or 0..20: report the prompt's tokens' log-probabilities too (each
            given the tokens before it; the first token has none), with that many alternatives, on the request's
            first `GenerationChunk` (`GenerationChunk.prompt_logprobs`). Every prompt token is then prefilled: the
            prefix cache cannot supply a prompt's K/V without its logits.
        grammar: None (free text), or this sequence's `GrammarMatcher`: the sampler allows only the tokens it
            allows and advances it with each sampled token, so the output matches its grammar and EOS comes only
            once it is complete. It holds state: each sequence needs its own (`GrammarMatcher.fork`).
        logit_bias: token id -> value in [-100, 100] added to that token's logit before every step's sampling
            (greedy included, and before a grammar's mask), as OpenAI's ``logit_bias``: +-100 in effect forces or
            bans a token. Log-probabilities stay those of the raw logits.
        reasoning_tags: (open, close) tags of the model's reasoning block, so that `stop` strings apply to the
            answer only: a block the output starts with (after blank text) is searched only for `close`, and stop
            strings are looked for after it. An empty `open` means the output starts inside the block (the prompt
            opened it). None (the default): stop strings apply from the first character.
        presence_penalty: subtracted once from the logit of every token already generated (OpenAI's definition,
            in [-2, 2]); 0 disables it.
        frequency_penalty: subtracted from the logit of every generated token, times the number of times it was
            generated (OpenAI's definition, in [-2, 2]); 0 disables it.
        repetition_penalty: > 0; the logit of every token in the prompt or the output is divided by it when
            positive and multiplied by it when negative (CTRL, Keskar et al. 2019, as Hugging Face applies it);
            1 disables it.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarMatcher | None = field(default=None, repr=False, compare=False)
    logit_bias: dict[int, float] = field(default_factory=dict)
    reasoning_tags: tuple[str, str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        """Raise ValueError naming the field when a value is out of range or of the wrong type.

        Each message starts with the field's name (the server reports it as the error's parameter). Types are
        checked too: a wrong one would otherwise fail later, inside the engine thread (a `stop` string, not a
        list, would stop at any of its characters).
        """
        for name in ("max_tokens", "top_k"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p"):
            if not _is_int(getattr(self, name)) and not isinstance(getattr(self, name), float):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(map(_is_int, self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if not isinstance(self.logit_bias, dict) or not all(
            _is_int(t)
            and t >= 0
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
            for t, v in self.logit_bias.items()
        ):
            raise ValueError(
                f"logit_bias must map token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], "
                f"got {self.logit_bias!r}"
            )
        if self.grammar is not None and not isinstance(self.grammar, GrammarMatcher):
            raise ValueError(f"grammar must be null or a GrammarMatcher, got {type(self.grammar).__name__}")
        if self.reasoning_tags is not None and not (
            isinstance(self.reasoning_tags, tuple)
            and len(self.reasoning_tags) == 2
            and all(isinstance(t, str) for t in self.reasoning_tags)
            and self.reasoning_tags[1]
        ):
            raise ValueError(f"reasoning_tags must be null or (open, close) strings, got {self.reasoning_tags!r}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_int(value) and not isinstance(value, float):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def penalized(self) -> bool:
        """True when any repetition penalty is on (the sampler then needs the sequence's tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature below `MIN_TEMPERATURE`, 0 included, or top_k 1)."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def _is_int(value: object) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class TokenLogprob:
    """The log-probability of one generated token under the model's distribution (see `SamplingParams.logprobs`).

    Attributes:
        token_id: the generated token.
        logprob: its log-probability (float32 log_softmax of the raw logits, before any sampling transform).
        top: the most likely tokens as (token id, logprob), most likely first (tied values in no set
            order); as many as the request's `logprobs`. The generated token is among them only
            when it is that likely.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationChunk:
    """One streamed piece of a request's output.

    Attributes:
        text: new text since the previous chunk; never ends inside a UTF-8 character and never
            holds any part of a matched stop string.
        token_ids: the new token ids behind `text` (may be non-empty while `text` is empty, when
            text is held back for an incomplete character or a possible stop string).
        finish_reason: None while running; "stop" (EOS, stop token or stop string), "length"
            (max_tokens or the context limit) or "abort" (cancelled) on the last chunk.
        stop_reason: the stop string or stop token id that ended the request, if any.
        num_prompt_tokens: tokens in the prompt.
        num_output_tokens: tokens generated so far.
        num_cached_tokens: prompt tokens whose K/V the prefix cache supplied (not prefilled for this request).
        num_cache_write_tokens: prompt tokens in the full blocks this request prefilled and left in the prefix
            cache for later requests (Anthropic's cache creation); 0 with the prefix cache off.
        logprobs: with `SamplingParams.logprobs` set, one `TokenLogprob` per entry of `token_ids`, in order;
            else None.
        prompt_logprobs: with `SamplingParams.prompt_logprobs` set, on the request's first chunk only: one entry
            per prompt token, None for the first (nothing precedes it), else its `TokenLogprob` given the tokens
            before it; else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_cache_write_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
