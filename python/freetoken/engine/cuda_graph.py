"""The decode step on CUDA: fixed-shape inputs, captured once per padded batch size in a CUDA graph.

A decode step (every sequence one new token) launches a few hundred small kernels; launched one by one from
Python, their CPU cost dominates the step (benches/decode_fused.py --profile). Here the step's inputs live in
static device buffers, attention is the Triton paged-decode kernel (it reads block tables and lengths from
memory) and the experts the Triton grouped kernel (no host sync), so the whole forward plus the LM head is
captured per batch size in {1, 2, 4, 8, 16, 32, 64} up to max_num_seqs, and a step is a few copies and one
replay. Rows that pad a batch up to its size write their K/V into the KV cache's reserved null block.

Expert-cache backends on CUDA serve the routed experts from a host driver thread through a handshake in mapped
pinned memory (`freetoken.moe.handshake`), so their whole step is one graph too, with no Python between layers.
Backends that sync with the host in every MoE layer otherwise (routing decides copies and CPU work) have their
step captured piecewise (as vLLM's piecewise CUDA graphs): one graph per span from one MoE layer's experts to
the next one's router (residual add, attention, norms, router), and the routed experts run eagerly between
replays on the real rows only. Each span ends by packing what the host needs (top-k ids, routing weights and the
hidden states in float32) into a device "mailbox", three blocks one after the other, so one copy brings it all to
pinned host memory; the next span adds both expert sums (slots and CPU) to the residual itself.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from freetoken._core import mail_layout
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.sequence import Sequence
from freetoken.models.attention import AttentionMetadata
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM
from freetoken.moe.backend import DrivenExpertBackend
from freetoken.moe.pinned import PinnedBuffers

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# MoE layers per graph of a driven decode step. A graph's launch returns only once its work is queued, and work
# queued behind a kernel that spins on the driver is not consumed; if a launch waited for queue space while the
# device spun on a layer whose fills the driver cannot issue until the launch returns (one CUDA context), neither
# would move (one graph of all 48 layers of Qwen3-30B-A3B did, on the H200). So the step is launched in parts
# small enough that two of them queue whole, each part once the driver has served the first layer of the part
# before: 4 layers (what the tests' 4-layer model runs in one graph) per part.
LAYERS_PER_GRAPH = 4


def _capture(run, pool):
    """Capture `run()` in a new CUDA graph sharing memory pool `pool` (None: a new one); (graph, its pool, what
    `run` returned)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, graph.pool(), out


class DecodeRunner:
    """Runs decode steps of up to `max_batch` sequences from static buffers, replaying CUDA graphs when captured.

    Args:
        model: the model, on a CUDA device.
        kv: the KV cache (its `null_block` takes the padding rows' K/V).
        max_batch: largest batch this runner takes (<= 64).
        max_model_len: longest context, which sizes the block-table buffer.
        use_graphs: capture CUDA graphs (False runs the same fixed-shape step eagerly).
    """

    def __init__(
        self,
        model: Qwen3MoeForCausalLM,
        kv: KVCache,
        max_batch: int,
        max_model_len: int,
        use_graphs: bool,
        piecewise: bool = False,
    ) -> None:
        self.model = model
        self.kv = kv
        self.piecewise = piecewise
        device = kv.layers[0][0].device
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [min(max_batch, BATCH_SIZES[-1])]
        self.max_batch = self.sizes[-1]
        width = kv.blocks_for(max_model_len)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # Hybrid models: each row's recurrent-state slot; padding rows use the pool's scratch slot.
        self.state_pool = getattr(model, "state_pool", None)
        self.state_slots = None
        if self.state_pool is not None:
            self.state_slots = torch.full((n,), self.state_pool.null_slot, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.handshake = None  # set when the expert backend serves a whole-step graph from its driver thread
        if piecewise:
            cfg = model.config
            dtype = model.lm_head.weight.dtype
            hidden, k = cfg.hidden_size, cfg.num_experts_per_tok
            self.top_k, self.hidden_size = k, hidden
            self.x_resid = torch.zeros(n, hidden, dtype=dtype, device=device)
            self.moe_out = torch.zeros(n, hidden, dtype=dtype, device=device)
            self.cos = torch.zeros(n, cfg.rotary_dim, dtype=dtype, device=device)
            self.sin = torch.zeros(n, cfg.rotary_dim, dtype=dtype, device=device)
            self.logits = torch.zeros(n, cfg.vocab_size, dtype=torch.float32, device=device)
            moe = cfg.moe_layers
            # (first layer, MoE layer that ends the span or -1): spans run between the MoE layers' experts.
            self.spans = list(zip([0] + [m + 1 for m in moe], moe + [-1], strict=True))
            self.span_graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
            if use_graphs and isinstance(model.experts, DrivenExpertBackend):
                # None where the backend cannot (the CPU device); it has its own host mailbox.
                self.handshake = model.experts.device_handshake(k, self.sizes)
            if self.handshake is not None:
                # Spans in graphs of LAYERS_PER_GRAPH MoE layers each (the last span, the LM head, in the last).
                num_spans = len(self.spans)
                self.parts = [
                    range(a, min(a + LAYERS_PER_GRAPH, num_spans)) for a in range(0, num_spans, LAYERS_PER_GRAPH)
                ]
                if len(self.parts) > 1 and len(self.parts[-1]) == 1:  # no graph of the LM head alone
                    self.parts[-2:] = [range(self.parts[-2].start, num_spans)]
            else:  # the router's outputs and the CPU sum between replays, and the mailbox for `forward_staged`
                self.h_moe = torch.zeros(n, hidden, dtype=dtype, device=device)
                self.topk_ids = torch.zeros(n, k, dtype=torch.int64, device=device)
                self.topk_weights = torch.zeros(n, k, dtype=dtype, device=device)
                self.cpu_out = torch.zeros(n, hidden, dtype=torch.float32, device=device)
                self.mail_row = mail_layout(1, k, hidden)[2]  # bytes per token: the driver's mailbox layout
                self.mail = torch.zeros(n * self.mail_row, dtype=torch.uint8, device=device)
                self.host = PinnedBuffers(pin=device.type == "cuda")
                self.mail_host = self.host.get("mail", (n * self.mail_row,), torch.uint8)
        if use_graphs:
            self._capture()

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_lens=[1] * size,
            context_lens=[],
            decode_gather=None,
            decode_mask=None,
            decode_rows=None,
            prefill_spans=[],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            kv_block_size=self.kv.block_size,
            state_slots=None if self.state_slots is None else self.state_slots[:size],
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self._meta(size), self.kv.layers)
        return self.model.compute_logits(hidden)

    def _mail(self, buf: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of mailbox `buf` for a padded batch of `size` (`freetoken.moe.handshake.mail_views`)."""
        from freetoken.moe.handshake import mail_views

        return mail_views(buf, size, self.top_k, self.hidden_size)

    def _span(self, size: int, index: int, driven: bool = False):
        """Run span `index` on the static buffers: from the previous MoE layer's output (or the embeddings) to
        the next MoE layer's router outputs (or the logits). Piecewise, the router's outputs go to the static
        buffers and the mailbox; `driven`, where the handshake packs the mailbox and the slot kernel follows in
        the same graph, only the residual is kept, and (hidden, ids, weights) are returned; the CPU experts' sum
        is then already in `moe_out` (`DeviceHandshake.fetch_cpu` adds it there)."""
        start, moe_layer = self.spans[index]
        meta = self._meta(size)
        model = self.model
        if index == 0:
            x, residual = model.model.embed_tokens(self.input_ids[:size]), None
            cos, sin = model.model.rotary(meta.positions, x.dtype)
            self.cos[:size].copy_(cos)
            self.sin[:size].copy_(sin)
        else:  # the last MoE layer's expert sum (the CPU's added in `fetch_cpu` when driven), and its residual
            residual = self.x_resid[:size]
            x = self.moe_out[:size] if driven else self.moe_out[:size] + self.cpu_out[:size].to(residual.dtype)
        # The MoE layer's residual stream goes straight into x_resid (the next span's residual).
        h, _, _ = model.run_until_moe(
            x, residual, start, (self.cos[:size], self.sin[:size]), self.kv.layers, meta, self.x_resid[:size]
        )
        if moe_layer < 0:
            self.logits[:size].copy_(model.compute_logits(h))
            return None
        ids, weights = model.model.layers[moe_layer].mlp.gate(h)
        if driven:
            return h, ids, weights
        self.h_moe[:size].copy_(h)
        self.topk_ids[:size].copy_(ids)
        self.topk_weights[:size].copy_(weights)
        mail_ids, mail_weights, mail_hidden = self._mail(self.mail, size)
        mail_ids.copy_(ids)
        mail_weights.copy_(weights)
        mail_hidden.copy_(h)
        return None

    def _forward_driven(self, size: int, spans: range) -> None:
        """Part of the decode step with the routed experts served through the backend's handshake (its driver
        thread plans, fills and runs CPU experts while this runs on the device): the spans in `spans`, and after
        each the MoE layer's mailbox post, plan fetch, slot kernel (the hits' tiles, then the fills' once they have
        landed) and CPU sum's fetch (`freetoken.moe.handshake`).
        """
        hs = self.handshake
        experts = self.model.experts
        if spans.start == 0:
            hs.begin()
        for index in spans:
            moe_layer = self.spans[index][1]
            routed = self._span(size, index, driven=True)
            if routed is None:
                break
            h, ids, weights = routed
            hs.post(moe_layer, ids, weights, h)
            _, pairs, tiles = hs.fetch_plan(moe_layer, size)
            experts.run_slots(
                h,
                weights,
                pairs,
                tiles,
                self.moe_out[:size],
                before_stage=lambda _, layer=moe_layer: hs.wait_fills(layer),
            )
            hs.fetch_cpu(moe_layer, size, self.moe_out[:size])

    def _run_driven(self, size: int, batch: int) -> None:
        """Replay the parts of a driven step, each once the driver has served the first MoE layer of the part
        before: then at most two parts are queued (see `LAYERS_PER_GRAPH`), and the next part is in the queue
        before the device reaches it, so no launch latency shows between parts."""
        hs = self.handshake
        hs.start(batch, size)
        try:
            for i, graph in enumerate(self.span_graphs[size]):
                if i:
                    hs.wait_served(self.spans[self.parts[i - 1][0]][1])
                graph.replay()
        finally:
            hs.finish()  # the driver's report; raises its error after the device ran to the end

    def _run_piecewise(self, size: int, batch: int) -> torch.Tensor:
        graphs = self.span_graphs.get(size)
        experts = self.model.experts  # one backend serves every MoE layer
        staged = isinstance(experts, DrivenExpertBackend)
        h, weights, out = self.h_moe[:batch], self.topk_weights[:batch], self.moe_out[:batch]
        if staged:
            mail, mail_host = self.mail[: size * self.mail_row], self.mail_host[: size * self.mail_row]
            host_ids, host_weights, host_hidden = (v[:batch] for v in self._mail(self.mail_host, size))
        for index, (_, moe_layer) in enumerate(self.spans):
            if graphs is not None:
                graphs[index].replay()
            else:
                self._span(size, index)
            if moe_layer < 0:
                continue
            # The routed experts of the real rows, eagerly (host sync, copies, CPU work).
            if staged:
                mail_host.copy_(mail, non_blocking=True)
                experts.forward_staged(
                    moe_layer, h, weights, host_ids, host_weights, host_hidden, out=out, cpu_out=self.cpu_out
                )
            else:
                out.copy_(experts.forward(moe_layer, h, self.topk_ids[:batch], weights))
        return self.logits[:batch]

    @torch.inference_mode()
    def _capture(self) -> None:
        self._pad_from(0)
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            if self.handshake is not None:
                # Warm-up (compiles the kernels): the driver answers every layer with an empty plan.
                self.handshake.start(size, size, idle=True)
                for part in self.parts:
                    self._forward_driven(size, part)
                torch.cuda.synchronize()
                self.handshake.finish()
                graphs = []
                for part in self.parts:
                    graph, pool, _ = _capture(partial(self._forward_driven, size, part), pool)
                    graphs.append(graph)
                self.span_graphs[size] = graphs
                continue
            if self.piecewise:
                graphs = []
                for index in range(len(self.spans)):
                    self._span(size, index)  # compiles kernels and warms the allocator outside the capture
                    torch.cuda.synchronize()
                    graph, pool, _ = _capture(partial(self._span, size, index), pool)
                    graphs.append(graph)
                self.span_graphs[size] = graphs
                continue
            self._forward(size)  # compiles the Triton kernels and warms the allocator outside the capture
            torch.cuda.synchronize()
            graph, pool, logits = _capture(partial(self._forward, size), pool)
            self.graphs[size] = (graph, logits)
        kind = (
            "whole-step, experts served by the decode driver"
            if self.handshake is not None
            else "piecewise (one graph per span between MoE layers)"
            if self.piecewise
            else "whole-step"
        )
        log.info("captured %s CUDA graphs of the decode step for batch sizes %s", kind, self.sizes)

    def _pad_from(self, start: int) -> None:
        null = self.kv.null_block
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.slot_mapping[start:] = null * self.kv.block_size
        self.block_tables[start:, 0] = null
        self.seq_lens[start:] = 1
        if self.state_slots is not None:
            self.state_slots[start:] = self.state_pool.null_slot

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run the decode step of `seqs` (each with exactly one uncomputed token, its blocks allocated).

        Returns:
            [len(seqs), vocab] float32 logits (a view of a static buffer, valid until the next call).
        """
        batch = len(seqs)
        size = next(s for s in self.sizes if s >= batch)
        bs = self.kv.block_size
        ids, pos, slots, lens = [], [], [], []
        width = max(len(s.block_table) for s in seqs)
        tables = torch.zeros(batch, width, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            p = seq.num_computed
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        self.input_ids[:batch].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:batch].copy_(torch.tensor(pos), non_blocking=True)
        self.slot_mapping[:batch].copy_(torch.tensor(slots), non_blocking=True)
        self.seq_lens[:batch].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:batch, :width].copy_(tables, non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:batch].copy_(torch.tensor([s.state_slot for s in seqs]), non_blocking=True)
        self._pad_from(batch)
        if self.handshake is not None:
            self._run_driven(size, batch)
            return self.logits[:batch]
        if self.piecewise:
            return self._run_piecewise(size, batch)
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:batch]
        return self._forward(size)[:batch]
