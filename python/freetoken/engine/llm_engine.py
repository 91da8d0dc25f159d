"""The synchronous engine core: requests in, one step at a time, token and text deltas out.

Not thread-safe: `AsyncEngine` drives it from one thread.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.admission import Admission, default_share
from freetoken.engine.kv_cache import KVCache, plan_kv_cache
from freetoken.engine.kv_host import HostKVTier, default_host_bytes
from freetoken.engine.model_runner import ModelRunner
from freetoken.engine.resize import cache_sizes
from freetoken.engine.scheduler import Scheduler
from freetoken.engine.sequence import Sequence
from freetoken.engine.state_checkpoints import MarkSet, StateCheckpoints, default_budget_bytes, host_budget_bytes
from freetoken.engine.state_pool import RecurrentStatePool
from freetoken.engine.stop import OutputText
from freetoken.engine.structured import GrammarBackend
from freetoken.engine.types import FinishReason, GenerationChunk, SamplingParams, TokenLogprob
from freetoken.errors import FreetokenError
from freetoken.models.loader import (
    TensorIndex,
    check_finite_weights,
    init_dummy_weights,
    load_checkpoint,
    resolve_dtype,
)
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM
from freetoken.moe import make_expert_backend, resolve_backend
from freetoken.moe.budget import check_host_memory
from freetoken.moe.expert_cache import ExpertCacheBackend
from freetoken.moe.routing_replay import describe as describe_routing
from freetoken.moe.routing_replay import install_replay
from freetoken.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class RequestError(FreetokenError, ValueError):
    """A request the engine cannot take (prompt too long, bad parameters); the message names the field."""


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    chunk: GenerationChunk


class LLMEngine:
    """Model, KV cache, scheduler and per-request output state.

    Args:
        model: the model with its expert backend attached, on `device`.
        model_cfg: its config.
        engine_cfg: serving settings.
        tokenizer: for output text and stop strings; None runs on token ids alone (stop strings then rejected).
    """

    def __init__(
        self,
        model: Qwen3MoeForCausalLM,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig,
        tokenizer: Tokenizer | None,
    ) -> None:
        engine_cfg.validate()
        self.model_cfg = model_cfg
        self.cfg = engine_cfg
        self.tokenizer = tokenizer
        self.device = torch.device(engine_cfg.device)
        dtype = next(model.parameters()).dtype
        plan = plan_kv_cache(model_cfg, engine_cfg, dtype)
        self.max_model_len = plan.max_model_len
        self.kv = KVCache(
            model_cfg.num_kv_layers,  # hybrid models: the full-attention layers only
            model_cfg.num_key_value_heads,
            model_cfg.head_dim,
            plan.num_blocks,
            plan.block_size,
            dtype,
            self.device,
        )
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.2f GB",
            plan.num_blocks,
            plan.block_size,
            plan.num_blocks * plan.block_size,
            plan.nbytes / 1e9,
        )
        self.state_pool = None
        if model_cfg.linear_layers:
            self.state_pool = RecurrentStatePool(model_cfg, engine_cfg.max_num_seqs, dtype, self.device)
            model.attach_state(self.state_pool)
            log.info(
                "recurrent-state pool: %d slots x %.3g MB (%d linear-attention layers) = %.2f GB",
                engine_cfg.max_num_seqs,
                RecurrentStatePool.bytes_per_slot(model_cfg, dtype) / 1e6,
                len(model_cfg.linear_layers),
                self.state_pool.nbytes / 1e9,
            )
        self.checkpoints = self._make_checkpoints(model_cfg, engine_cfg, tokenizer, dtype)
        self.experts = model.experts
        self.kv_host = self._make_kv_host(model_cfg, engine_cfg, dtype)
        self.admission = Admission(engine_cfg.max_seqs_per_request or default_share(engine_cfg.max_num_seqs))
        self.scheduler = Scheduler(
            self.kv,
            engine_cfg.max_num_seqs,
            engine_cfg.max_prefill_tokens,
            prefix_cache=not engine_cfg.no_prefix_cache,
            admission=self.admission,
            state_pool=self.state_pool,
            checkpoints=self.checkpoints,
            kv_host=self.kv_host,
        )
        if self.kv_host is not None and not self.scheduler.prefix_cache.enabled:
            self.kv_host = None  # a hybrid model without checkpoints: no prefix cache, so nothing to keep
        self._synced = True  # the last step ended in a host sync (it sampled): the next one can be timed
        if engine_cfg.no_prefix_cache:
            log.info("prefix cache: off (--no-prefix-cache); every prompt is prefilled in full")
        elif self.state_pool is not None and self.checkpoints is None:
            log.info(
                "prefix cache: off for a hybrid model without state checkpoints (--state-checkpoints off); "
                "every prompt is prefilled in full"
            )
        else:
            log.info(
                "prefix cache: on; holds up to %d tokens in the KV cache's blocks that no request holds",
                self.scheduler.prefix_cache.capacity_tokens,
            )
        self.runner = ModelRunner(
            model,
            self.kv,
            self.device,
            engine_cfg.max_num_seqs,
            self.max_model_len,
            engine_cfg.enforce_eager,
        )
        self.eos_ids = set(tokenizer.eos_token_ids if tokenizer else ()) | set(model_cfg.eos_token_ids)
        # Compiles response formats into per-sequence grammar matchers (`SamplingParams.grammar`); its token trie is
        # built on the first constrained request, so serving free text costs nothing.
        self.grammars = (
            GrammarBackend(tokenizer, model_cfg.vocab_size, sorted(self.eos_ids)) if tokenizer is not None else None
        )
        self._seqs: dict[str, Sequence] = {}
        self._rng = random.Random(engine_cfg.seed)
        self.num_steps = 0
        self.routing = describe_routing(model)
        self.num_resizes = 0  # cache resizes done (`freetoken.engine.resize`), and the last one's answer
        self.last_resize: dict | None = None

    def _make_checkpoints(
        self, model_cfg: ModelConfig, engine_cfg: EngineConfig, tokenizer: Tokenizer | None, dtype: torch.dtype
    ) -> StateCheckpoints | None:
        """Hybrid models' recurrent-state snapshots (`freetoken.engine.state_checkpoints`), None when off."""
        budget = default_budget_bytes(engine_cfg, model_cfg, dtype) if self.state_pool is not None else 0
        if not budget:
            return None
        marks = MarkSet.from_tokenizer(tokenizer) if tokenizer is not None else MarkSet([])
        checkpoints = StateCheckpoints(
            engine_cfg.state_checkpoints,
            marks,
            self.state_pool,
            self.kv,
            budget,
            engine_cfg.state_checkpoint_spacing,
            model_cfg,
            dtype,
            host_budget_bytes(engine_cfg, model_cfg, dtype),
        )
        log.info(
            "state checkpoints: %s; %d snapshots x %.3g MB = %.2f GB (--state-checkpoint-gb), %d more in host memory "
            "(--state-checkpoint-host-gb)%s",
            checkpoints.mode,
            checkpoints.pool.capacity,
            checkpoints.nbytes_each / 1e6,
            checkpoints.pool.capacity * checkpoints.nbytes_each / 1e9,
            checkpoints.pool.host_capacity,
            f"; marks after {len(marks.sequences)} token sequences, every {engine_cfg.state_checkpoint_spacing} "
            "tokens deep in a prompt"
            if checkpoints.mode == "marks"
            else "",
        )
        return checkpoints

    def _make_kv_host(self, model_cfg: ModelConfig, engine_cfg: EngineConfig, dtype: torch.dtype) -> HostKVTier | None:
        """The prefix cache's host-RAM tier (`freetoken.engine.kv_host`), None when its budget is 0."""
        cache = self.experts if isinstance(self.experts, ExpertCacheBackend) else None
        mode = cache.mode if cache is not None else "fused"
        nbytes = default_host_bytes(engine_cfg, model_cfg, dtype, mode)
        num_slots = nbytes // self.kv.bytes_per_block
        if num_slots < 1:
            if engine_cfg.kv_host_gb > 0:
                log.warning("--kv-host-gb %s holds no KV block; no host tier", engine_cfg.kv_host_gb)
            return None
        profile = cache.planner.profile() if cache is not None else None
        # Kept free ahead of need: the blocks one step can evict, its prompt tokens' and one per decoding sequence.
        headroom = self.kv.blocks_for(engine_cfg.max_prefill_tokens) + engine_cfg.max_num_seqs
        tier = HostKVTier(self.kv, num_slots, profile[0] if profile else None, headroom=headroom)
        cost = tier.cost.stats()
        log.info(
            "KV host tier: up to %d blocks = %d tokens, %.2f GB %s as it fills (%.2f GB now, one step's evictions), "
            "%.0f MB at a time (--kv-host-gb%s); a host hit is copied back at %.1f GB/s (%s) + %.0f us instead of "
            "prefilled again from the crossover on (measured once prefill steps ran)",
            num_slots,
            tier.capacity_tokens,
            tier.nbytes / 1e9,
            "pinned" if tier.stream is not None else "in a second buffer",
            tier.allocated_nbytes / 1e9,
            tier.chunk_slots * tier.bytes_per_block / 1e6,
            "" if engine_cfg.kv_host_gb >= 0 else ", default: free RAM after the expert pool less a margin",
            cost["h2d_gbps"],
            "bandwidth profile" if profile else "measured",
            cost["copy_fixed_us"],
        )
        return tier

    @classmethod
    def from_dir(cls, model_dir: str | Path, engine_cfg: EngineConfig) -> LLMEngine:
        """Load config, tokenizer and weights (or seeded random weights with `dummy_weights`) from `model_dir`."""
        engine_cfg.validate()  # before any loading: a bad flag fails fast
        model_dir = Path(model_dir)
        model_cfg = ModelConfig.from_dir(model_dir)
        device = torch.device(engine_cfg.device)
        if device.type == "cuda" and device.index is not None:
            # Triton launches and streams without an explicit device use the thread's current one (cuda:N).
            torch.cuda.set_device(device)
        dtype = resolve_dtype(engine_cfg.dtype, device)
        # Missing files fail here, with the loader's messages, before anything is allocated.
        index = None if engine_cfg.dummy_weights else TensorIndex.scan(model_dir)
        check_host_memory(engine_cfg, model_cfg, dtype, resolve_backend(engine_cfg.moe_backend, device))
        experts = make_expert_backend(engine_cfg, model_cfg, None if engine_cfg.dummy_weights else model_dir, dtype)
        if engine_cfg.dummy_weights:
            model = init_dummy_weights(model_cfg, experts, device, dtype, seed=engine_cfg.seed)
            if engine_cfg.replay_routing:  # before the engine captures its graphs: they replay the trace too
                install_replay(model, engine_cfg.replay_routing, seed=engine_cfg.seed)
        else:
            model = load_checkpoint(model_dir, experts, device, dtype, cfg=model_cfg, index=index)
        if not engine_cfg.allow_nonfinite:
            check_finite_weights(model, experts)
        tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        return cls(model, model_cfg, engine_cfg, tokenizer)

    def add_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, group: str | None = None
    ) -> None:
        """Queue a request. Raises RequestError for an empty or over-long prompt or bad parameters.

        `group` names the API request this one is a choice of (its ``n`` choices are one group each): a group
        runs at most `EngineConfig.max_seqs_per_request` sequences at once (`freetoken.engine.admission`).
        """
        if request_id in self._seqs:
            raise RequestError(f"request_id {request_id!r} is already running")
        self.check_request(prompt_ids, params)
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        text = OutputText(self.tokenizer, prompt_ids, params.stop, params.reasoning_tags) if self.tokenizer else None
        seq = Sequence(request_id, list(prompt_ids), params, generator, text)
        self._seqs[request_id] = seq
        self.admission.set_group(request_id, group)
        self.scheduler.add(seq)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Everything `add_request` checks about a request's own content, callable from any thread (it reads only
        constants): the server runs it before its response starts, so a bad request is a 400, not a stream that
        ends in an error.

        Raises:
            RequestError: the message starts with the field at fault (prompt, logit_bias, stop, or a parameter).
        """
        try:
            params.validate()
        except ValueError as e:
            raise RequestError(str(e)) from e
        if not prompt_ids:
            raise RequestError("prompt is empty")
        # The tokenizer's ids (special tokens included); the embedding rows past them are padding, never text.
        vocab_size = self.model_cfg.vocab_size
        if self.tokenizer is not None:
            vocab_size = min(vocab_size, self.tokenizer.vocab_size)
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        bad = [t for t in params.logit_bias if t >= vocab_size]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len} (max_model_len), "
                "with room for at least one new token"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model directory has no tokenizer.json")

    def abort(self, request_id: str) -> None:
        """Drop a request (no-op when unknown or finished); its KV blocks are freed at once."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
            self.admission.forget(request_id)

    def pause(self, request_id: str) -> None:
        """Stop stepping a running request whose output is not being read; it keeps its KV blocks
        (`Scheduler.pause`). No-op when unknown, finished or not running."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.scheduler.pause(seq)

    def resume(self, request_id: str) -> None:
        """Step a paused request again (`Scheduler.resume`); no-op when it is not paused."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.scheduler.resume(seq)

    def idle(self) -> None:
        """Work done while no request runs (the engine thread calls it when it goes idle after work): the KV host
        tier grows back to one step's worth of free pinned slots (`HostKVTier.reserve`), so the next request's
        evictions do not page-lock memory on its time."""
        if self.kv_host is not None:
            self.kv_host.reserve()

    def has_work(self) -> bool:
        """Whether a step has anything to run (paused requests do not count)."""
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """Run one step. Returns an output for every request that sampled a token or finished."""
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            return []
        start = time.perf_counter()
        try:
            tokens, logprobs = self.runner.run(scheduled)
        except BaseException:
            # The step may have written part of its K/V, or advanced `num_computed` past K/V it never finished:
            # its sequences drop their blocks (none of them indexed yet) and would start again from their tokens.
            self.scheduler.abandon(scheduled)
            for seq in sorted(scheduled.seqs, key=lambda s: s.arrival, reverse=True):
                self.scheduler.preempt(seq)
            raise
        self._time_prefill(scheduled, tokens, time.perf_counter() - start)
        self.scheduler.commit(scheduled)
        self.num_steps += 1
        outputs = []
        for seq, token, logprob in zip(scheduled.seqs, tokens, logprobs, strict=True):
            if token is not None:
                outputs.append(StepOutput(seq.request_id, self._append(seq, token, logprob)))
        return outputs

    def _time_prefill(self, step, tokens: list[int | None], seconds: float) -> None:
        """Feed the host tier's prefill-cost fit (`kv_host.CopyCost`) with a step that computed prompt tokens, when
        its time is the device's: it sampled (a host sync at its end) and so did the step before it."""
        synced = any(t is not None for t in tokens)
        if self.kv_host is not None and synced and self._synced and step.num_tokens > len(step.seqs):
            self.kv_host.cost.add_prefill(step.num_tokens, seconds)
        self._synced = synced

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> GenerationChunk:
        seq.token_ids.append(token)
        p = seq.params
        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        hidden_token = False
        if not p.ignore_eos and token in self.eos_ids:
            finish, stop_reason, hidden_token = "stop", token, True
        elif token in p.stop_token_ids:
            finish, stop_reason, hidden_token = "stop", token, True
        text = ""
        if seq.text is not None and not hidden_token:
            text, matched = seq.text.push([token])
            if matched is not None:
                finish, stop_reason = "stop", matched
        if finish is None and (seq.num_output >= p.max_tokens or len(seq.token_ids) >= self.max_model_len):
            finish = "length"
        if finish is not None and seq.text is not None and not isinstance(stop_reason, str):
            text += seq.text.flush()  # held-back text that turned out not to start a stop string
        if finish is not None:
            seq.finish_reason, seq.stop_reason = finish, stop_reason
            self.abort(seq.request_id)
        return GenerationChunk(
            text=text,
            token_ids=[token],
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=seq.prompt_len,
            num_output_tokens=seq.num_output,
            num_cached_tokens=seq.num_cached_tokens or 0,
            num_cache_write_tokens=seq.num_cache_write_tokens,
            logprobs=[logprob] if logprob is not None else None,
            prompt_logprobs=self._take_prompt_logprobs(seq),
        )

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
        """The prompt's log-probabilities for the chunk of its first token (`SamplingParams.prompt_logprobs`)."""
        if seq.params.prompt_logprobs is None or seq.num_output != 1:
            return None
        if seq.prompt_len == 1:  # its one position predicts the output: it may have run in the decode runner
            return [None]
        assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == seq.prompt_len, "a prompt position ran"
        return seq.prompt_logprobs

    def stats(self) -> dict:
        """Engine counters (JSON-able)."""
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_paused": len(self.scheduler.paused),
            "kv_blocks_total": self.kv.num_blocks,
            "kv_blocks_free": self.scheduler.prefix_cache.num_free,
            "prefix_cache": self.scheduler.prefix_cache.stats(),
            "kv_host": self.kv_host.stats() if self.kv_host is not None else None,
            **(
                {"state_slots_total": self.state_pool.num_slots, "state_slots_free": self.state_pool.num_free}
                if self.state_pool is not None
                else {}
            ),
            **({"state_checkpoints": self.checkpoints.stats()} if self.checkpoints is not None else {}),
            "num_steps": self.num_steps,
            "routing": self.routing,
            "moe_backend": self.experts.stats(),
            "cache": cache_sizes(self),
        }
