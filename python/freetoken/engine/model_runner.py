"""Runs one scheduled step through the model: builds the flat token batch and its attention metadata, runs the
forward pass, and samples the next token of every sequence whose uncomputed tokens all ran."""

from __future__ import annotations

import gc

import torch

from freetoken.engine.cuda_graph import DecodeRunner, make_decode_runner
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.sampler import logprobs_of, sample_with_logprobs
from freetoken.engine.scheduler import ScheduledStep
from freetoken.engine.sequence import Sequence
from freetoken.engine.types import TokenLogprob
from freetoken.models.attention import AttentionMetadata
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM


class ModelRunner:
    """Owns the model and the KV cache tensors on the compute device.

    Decode-only steps on CUDA of at most 64 sequences go through a `DecodeRunner` (fixed shapes, CUDA graphs unless
    `enforce_eager`; which of the three runners, `make_decode_runner` picks from the expert backend); every other
    step runs eagerly with the torch attention path.
    """

    def __init__(
        self,
        model: Qwen3MoeForCausalLM,
        kv: KVCache,
        device: torch.device,
        max_num_seqs: int = 0,
        max_model_len: int = 0,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.decode: DecodeRunner | None = None
        self._decode_args = (max_num_seqs, max_model_len, not enforce_eager)
        self.build_decode()

    def build_decode(self) -> None:
        """Build the decode runner (CUDA only): its static buffers, the expert backend's device handshake (which
        holds the slots' address) and its CUDA graphs, which hold the KV and slot tensors' addresses. A resize of
        either (`freetoken.engine.resize`) calls `release_decode` first and this again after."""
        max_num_seqs, max_model_len, use_graphs = self._decode_args
        if self.device.type == "cuda" and max_num_seqs > 0:
            self.decode = make_decode_runner(self.model, self.kv, max_num_seqs, max_model_len, use_graphs)

    def release_decode(self) -> None:
        """Drop the decode runner: its graphs and graph memory pool, and the decode driver thread (its drop joins
        it), so the slots and KV tensors they point into may be freed."""
        self.decode = None
        if self.device.type == "cuda":
            gc.collect()  # the graphs and the driver go with the last reference, now, not at some later collection
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """Run `step` and advance each sequence's `num_computed`.

        Both paths hand their logits to `sample_with_logprobs` (the decode runner's are a view of its static
        buffer, read before the next step), so log-probabilities work with and without CUDA graphs.

        Returns:
            Per sequence of the step, the sampled next token, or None for a prompt chunk that is not the last;
            and per sequence its token's `TokenLogprob` when its params ask for logprobs, else None.
        """
        experts = self.model.experts
        # A prompt position whose logits give a prompt token's log-probability runs eagerly (the decode runner
        # keeps only the last position's logits of each sequence).
        prompt_logits = any(s.wants_prompt_logprobs and s.num_computed < s.prompt_len - 1 for s in step.seqs)
        if (
            self.decode is not None
            and not prompt_logits
            and all(q == 1 for q in step.query_lens)
            and len(step.seqs) <= self.decode.max_batch
        ):
            if experts is not None:
                experts.begin_step(len(step.seqs), 0, self.model.config.num_experts_per_tok)
            logits = self.decode.run(step.seqs)
            for seq in step.seqs:
                seq.num_computed += 1
            tokens, logprobs = sample_with_logprobs(
                logits,
                [s.params for s in step.seqs],
                [s.generator for s in step.seqs],
                [s.token_ids for s in step.seqs],
                [s.prompt_len for s in step.seqs],
            )
            return list(tokens), logprobs
        input_ids: list[int] = []
        context_lens: list[int] = []
        for seq, q in zip(step.seqs, step.query_lens, strict=True):
            input_ids.extend(seq.token_ids[seq.num_computed : seq.num_computed + q])
            context_lens.append(seq.num_computed + q)
        meta = AttentionMetadata.build(
            step.query_lens, context_lens, [s.block_table for s in step.seqs], self.kv.block_size, self.device
        )
        if getattr(self.model, "state_pool", None) is not None:  # hybrid: each sequence's recurrent-state slot
            meta.state_slots = torch.tensor([s.state_slot for s in step.seqs], dtype=torch.int64, device=self.device)
            if step.captures is not None and any(step.captures.splits):  # snapshots inside prompt chunks
                meta.state_splits, meta.state_capture = step.captures.splits, step.captures.write
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        if experts is not None:
            prefill = sum(
                q for s, q in zip(step.seqs, step.query_lens, strict=True) if q > 1 or s.num_computed < s.prompt_len
            )
            experts.begin_step(len(input_ids), prefill, self.model.config.num_experts_per_tok)
        hidden = self.model(ids, meta, self.kv.layers)
        rows: list[int] = []
        sampled_seqs = []
        end = 0
        for seq, q, ctx in zip(step.seqs, step.query_lens, context_lens, strict=True):
            if seq.wants_prompt_logprobs:
                self._prompt_logprobs(seq, hidden[end : end + q], ctx - q)
            end += q
            seq.num_computed = ctx
            if ctx == len(seq.token_ids):
                rows.append(end - 1)
                sampled_seqs.append(seq)
        out: list[int | None] = [None] * len(step.seqs)
        out_logprobs: list[TokenLogprob | None] = [None] * len(step.seqs)
        if rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
            tokens, logprobs = sample_with_logprobs(
                logits,
                [s.params for s in sampled_seqs],
                [s.generator for s in sampled_seqs],
                [s.token_ids for s in sampled_seqs],
                [s.prompt_len for s in sampled_seqs],
            )
            by_seq = {id(s): (t, lp) for s, t, lp in zip(sampled_seqs, tokens, logprobs, strict=True)}
            out = [by_seq[id(s)][0] if id(s) in by_seq else None for s in step.seqs]
            out_logprobs = [by_seq[id(s)][1] if id(s) in by_seq else None for s in step.seqs]
        return out, out_logprobs

    # Rows of logits made at a time for prompt log-probabilities: a [rows, vocab] float32 block (77 MB for Qwen's
    # 151,936-token vocabulary), not the whole chunk's.
    PROMPT_LOGITS_ROWS = 128

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int) -> None:
        """Append to `seq.prompt_logprobs` the log-probabilities of the prompt tokens that the rows of `hidden`
        (the hidden states of positions `start`, `start` + 1, ... of `seq`) predict: position p's logits give token
        p + 1's, for p + 1 < `seq.prompt_len`. A chunk that starts the prompt starts the list with None (token 0)."""
        if start == 0:
            seq.prompt_logprobs = [None]
        assert seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == start + 1, "prompt chunks in order"
        num_top = seq.params.prompt_logprobs or 0
        last = min(start + hidden.shape[0], seq.prompt_len - 1)  # positions [start, last) predict prompt tokens
        for lo in range(start, last, self.PROMPT_LOGITS_ROWS):
            hi = min(lo + self.PROMPT_LOGITS_ROWS, last)
            logits = self.model.compute_logits(hidden[lo - start : hi - start])
            targets = seq.token_ids[lo + 1 : hi + 1]
            seq.prompt_logprobs.extend(logprobs_of(logits, targets, [num_top] * len(targets)))
