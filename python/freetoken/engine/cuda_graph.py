"""The decode step on CUDA: fixed-shape inputs, captured once per padded batch size in CUDA graphs.

A decode step (every sequence one new token) launches a few hundred small kernels; launched one by one from
Python, their CPU cost dominates the step (benches/decode_fused.py --profile). Here the step's inputs live in
static device buffers, attention is the Triton paged-decode kernel (it reads block tables and lengths from
memory), and a step is a few copies and graph replays for batch sizes in {1, 2, 4, 8, 16, 32, 64} up to
max_num_seqs. Rows that pad a batch up to its size write their K/V into the KV cache's reserved null block.

Three runners, one per way the routed experts are reached (`freetoken/moe/README.md` draws them);
`make_decode_runner` picks one from what the expert backend declares (`graph_safe`, `DrivenExpertBackend`):

- `WholeStepRunner`: backends whose `forward` never syncs with the host (`fused`): the whole forward plus the LM
  head in one graph per batch size (or the same fixed-shape step eagerly).
- `DrivenGraphRunner`: backends whose layer step runs on the host (`DrivenExpertBackend`) with graphs on: the whole
  step in graphs, the routed experts served by the Rust decode driver through a handshake in mapped pinned memory
  (`freetoken.moe.handshake`), no Python between layers.
- `StagedRunner`: the other backends that sync with the host in every MoE layer: the spans from one MoE layer's
  experts to the next one's router (residual add, attention, norms, router) run as graphs (as vLLM's piecewise
  CUDA graphs) or eagerly, and the routed experts eagerly between them on the real rows only. A driven backend
  (graphs off) gets the routing through `forward_staged`: each span ends by packing the top-k ids, routing weights
  and hidden states in float32 into a device mailbox (the driver's layout), so one copy brings it all to pinned
  host memory; the next span adds both expert sums (slots and CPU) to the residual itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from freetoken._core import mail_layout
from freetoken.engine.kv_cache import KVCache
from freetoken.engine.sequence import Sequence
from freetoken.models.attention import AttentionMetadata
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock
from freetoken.moe.backend import DrivenExpertBackend
from freetoken.moe.handshake import DeviceHandshake, mail_views
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


def _capture(run: Callable[[], object], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any, object]:
    """Capture `run()` in a new CUDA graph sharing memory pool `pool` (None: a new one); (graph, its pool, what
    `run` returned)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, graph.pool(), out


def make_decode_runner(
    model: Qwen3MoeForCausalLM, kv: KVCache, max_batch: int, max_model_len: int, use_graphs: bool
) -> DecodeRunner:
    """The decode runner for `model`'s expert backend, from what the backend declares: `graph_safe` gets the whole
    step in one graph, a `DrivenExpertBackend` with graphs the driven graphs, anything else the staged spans.

    Args:
        model: the model, its experts attached (none: a model without MoE layers, whole-step).
        kv: the KV cache (its `null_block` takes the padding rows' K/V).
        max_batch: largest batch the runner takes (capped at 64).
        max_model_len: longest context, which sizes the block-table buffer.
        use_graphs: capture CUDA graphs (False runs the same fixed-shape step eagerly; needs CUDA when True).
    """
    experts = model.experts
    if experts is None or experts.graph_safe:
        return WholeStepRunner(model, kv, max_batch, max_model_len, use_graphs)
    if use_graphs and isinstance(experts, DrivenExpertBackend):
        return DrivenGraphRunner(model, kv, max_batch, max_model_len, experts)
    return StagedRunner(model, kv, max_batch, max_model_len, use_graphs)


class DecodeRunner:
    """What the three runners share: the static inputs of decode steps of up to `max_batch` sequences and `run`,
    which fills them and runs the step (`_step`, per runner).

    Args:
        model: the model (CUDA for graphs; the CPU runs the same step eagerly, Triton kernels interpreted).
        kv: the KV cache (its `null_block` takes the padding rows' K/V).
        max_batch: largest batch this runner takes (capped at 64).
        max_model_len: longest context, which sizes the block-table buffer.
    """

    kind = ""  # what the log line and the diagnostics call this runner

    def __init__(self, model: Qwen3MoeForCausalLM, kv: KVCache, max_batch: int, max_model_len: int) -> None:
        self.model = model
        self.kv = kv
        device = kv.layers[0][0].device
        self.device = device
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
        self.state_slots: torch.Tensor | None = None
        if self.state_pool is not None:
            self.state_slots = torch.full((n,), self.state_pool.null_slot, dtype=torch.int64, device=device)
        self.graphs: dict[int, Any] = {}  # batch size -> its captured graph(s), per runner; empty: eager

    @property
    def captured(self) -> bool:
        """True when the steps replay CUDA graphs."""
        return bool(self.graphs)

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

    def _pad_from(self, start: int) -> None:
        null = self.kv.null_block
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.slot_mapping[start:] = null * self.kv.block_size
        self.block_tables[start:, 0] = null
        self.seq_lens[start:] = 1
        if self.state_slots is not None and self.state_pool is not None:
            self.state_slots[start:] = self.state_pool.null_slot

    def _log_captured(self) -> None:
        log.info("captured %s CUDA graphs of the decode step for batch sizes %s", self.kind, self.sizes)

    def _step(self, size: int, batch: int) -> torch.Tensor:
        """Run the step of the `batch` real rows padded to `size` from the static buffers: [batch, vocab] float32
        logits."""
        raise NotImplementedError

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
        return self._step(size, batch)


class WholeStepRunner(DecodeRunner):
    """For backends whose `forward` never syncs with the host (`graph_safe`): the whole forward plus the LM head,
    captured in one CUDA graph per batch size when `use_graphs` (else the same fixed-shape step eagerly)."""

    kind = "whole-step"

    def __init__(
        self, model: Qwen3MoeForCausalLM, kv: KVCache, max_batch: int, max_model_len: int, use_graphs: bool
    ) -> None:
        super().__init__(model, kv, max_batch, max_model_len)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if use_graphs:
            self._capture()

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self._meta(size), self.kv.layers)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        self._pad_from(0)
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._forward(size)  # compiles the Triton kernels and warms the allocator outside the capture
            torch.cuda.synchronize()
            graph, pool, logits = _capture(partial(self._forward, size), pool)
            assert isinstance(logits, torch.Tensor)
            self.graphs[size] = (graph, logits)
        self._log_captured()

    def _step(self, size: int, batch: int) -> torch.Tensor:
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:batch]
        return self._forward(size)[:batch]


class _SpanRunner(DecodeRunner):
    """The step cut at the MoE layers' routed experts: span i runs from the MoE layer before it (its expert sum in
    `moe_out`, its residual in `x_resid`) or the embeddings to the next MoE layer's router, or to the logits."""

    def __init__(self, model: Qwen3MoeForCausalLM, kv: KVCache, max_batch: int, max_model_len: int) -> None:
        super().__init__(model, kv, max_batch, max_model_len)
        cfg = model.config
        dtype = model.lm_head.weight.dtype
        n, device = self.max_batch, self.device
        self.top_k, self.hidden_size = cfg.num_experts_per_tok, cfg.hidden_size
        self.x_resid = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.moe_out = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.cos = torch.zeros(n, cfg.rotary_dim, dtype=dtype, device=device)
        self.sin = torch.zeros(n, cfg.rotary_dim, dtype=dtype, device=device)
        self.logits = torch.zeros(n, cfg.vocab_size, dtype=torch.float32, device=device)
        moe = cfg.moe_layers
        # (first layer, MoE layer that ends the span or -1): spans run between the MoE layers' experts.
        self.spans = list(zip([0, *[m + 1 for m in moe]], [*moe, -1], strict=True))

    def _expert_sum(self, size: int) -> torch.Tensor:
        """The last MoE layer's routed-expert sum, the input of the next span."""
        return self.moe_out[:size]

    def _route(self, size: int, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Run span `index` on the static buffers: (the MoE layer's normed expert input [size, H], its top-k ids
        [size, k] and routing weights [size, k]), or None after the last span, whose logits are in `logits`."""
        start, moe_layer = self.spans[index]
        meta = self._meta(size)
        model = self.model
        if index == 0:
            x, residual = model.model.embed_tokens(self.input_ids[:size]), None
            cos, sin = model.model.rotary(meta.positions, x.dtype)
            self.cos[:size].copy_(cos)
            self.sin[:size].copy_(sin)
        else:
            residual = self.x_resid[:size]
            x = self._expert_sum(size)
        # The MoE layer's residual stream goes straight into x_resid (the next span's residual).
        h, _, _ = model.run_until_moe(
            x, residual, start, (self.cos[:size], self.sin[:size]), self.kv.layers, meta, self.x_resid[:size]
        )
        if moe_layer < 0:
            self.logits[:size].copy_(model.compute_logits(h))
            return None
        mlp = model.model.layers[moe_layer].mlp
        assert isinstance(mlp, SparseMoeBlock)  # the spans end at the MoE layers
        ids, weights = mlp.gate(h)
        return h, ids, weights


class DrivenGraphRunner(_SpanRunner):
    """For a `DrivenExpertBackend` on CUDA: the whole step in CUDA graphs (in parts of `LAYERS_PER_GRAPH` MoE
    layers), each MoE layer's routed experts served by the Rust decode driver thread through the backend's
    `DeviceHandshake` while the graph runs: the device posts the routing, fetches the plan, runs the slot kernel
    (the hits' tiles, then the fills' once they have landed) and adds the CPU experts' sum."""

    kind = "whole-step, experts served by the decode driver"

    def __init__(
        self,
        model: Qwen3MoeForCausalLM,
        kv: KVCache,
        max_batch: int,
        max_model_len: int,
        experts: DrivenExpertBackend,
    ) -> None:
        super().__init__(model, kv, max_batch, max_model_len)
        self.experts = experts
        self.handshake: DeviceHandshake = experts.device_handshake(self.top_k, self.sizes)
        # Spans in graphs of LAYERS_PER_GRAPH MoE layers each (the last span, the LM head, in the last).
        num_spans = len(self.spans)
        self.parts = [range(a, min(a + LAYERS_PER_GRAPH, num_spans)) for a in range(0, num_spans, LAYERS_PER_GRAPH)]
        if len(self.parts) > 1 and len(self.parts[-1]) == 1:  # no graph of the LM head alone
            self.parts[-2:] = [range(self.parts[-2].start, num_spans)]
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._capture()

    def _forward_driven(self, size: int, spans: range) -> None:
        """Part of the decode step: the spans in `spans`, and after each the MoE layer's mailbox post, plan fetch,
        slot kernel (the hits' tiles, then the fills' once they have landed) and CPU sum's fetch, which adds the
        CPU experts' sum into `moe_out` (`freetoken.moe.handshake`)."""
        hs = self.handshake
        if spans.start == 0:
            hs.begin()
        for index in spans:
            moe_layer = self.spans[index][1]
            routed = self._route(size, index)
            if routed is None:
                break
            h, ids, weights = routed
            hs.post(moe_layer, ids, weights, h)
            _, pairs, tiles = hs.fetch_plan(moe_layer, size)
            self.experts.run_slots(
                h,
                weights,
                pairs,
                tiles,
                self.moe_out[:size],
                before_stage=lambda _, layer=moe_layer: hs.wait_fills(layer),
            )
            hs.fetch_cpu(moe_layer, size, self.moe_out[:size])

    def _finish(self) -> None:
        """The driver's report of the step, booked by the backend; on an error (raised after the device ran to the
        end) the backend drops what the step's fills may have made stale first."""
        try:
            report = self.handshake.finish()
        except Exception:
            self.experts.after_failed_driven_step()
            raise
        self.experts.after_driven_step(report)

    @torch.inference_mode()
    def _capture(self) -> None:
        self._pad_from(0)
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            # Warm-up (compiles the kernels): the driver answers every layer with an empty plan.
            self.handshake.start(size, size, idle=True)
            for part in self.parts:
                self._forward_driven(size, part)
            torch.cuda.synchronize()
            self._finish()
            graphs = []
            for part in self.parts:
                graph, pool, _ = _capture(partial(self._forward_driven, size, part), pool)
                graphs.append(graph)
            self.graphs[size] = graphs
        self._log_captured()

    def _step(self, size: int, batch: int) -> torch.Tensor:
        """Replay the parts of the step, each once the driver has served the first MoE layer of the part before:
        then at most two parts are queued (see `LAYERS_PER_GRAPH`), and the next part is in the queue before the
        device reaches it, so no launch latency shows between parts."""
        hs = self.handshake
        hs.start(batch, size)
        try:
            for i, graph in enumerate(self.graphs[size]):
                if i:
                    hs.wait_served(self.spans[self.parts[i - 1][0]][1])
                graph.replay()
        finally:
            self._finish()  # raises the driver's error after the device ran to the end
        return self.logits[:batch]


class StagedRunner(_SpanRunner):
    """For backends that sync with the host in every MoE layer, without driven graphs: the spans between the MoE
    layers as CUDA graphs (`use_graphs`) or eagerly, and each MoE layer's routed experts eagerly between them, on the
    real rows only. A `DrivenExpertBackend` (the expert cache with graphs off) takes the routing from the pinned
    host mailbox the span's copies filled (`forward_staged`); any other backend takes `forward`."""

    kind = "piecewise (one graph per span between MoE layers)"

    def __init__(
        self, model: Qwen3MoeForCausalLM, kv: KVCache, max_batch: int, max_model_len: int, use_graphs: bool
    ) -> None:
        super().__init__(model, kv, max_batch, max_model_len)
        experts = model.experts
        assert experts is not None, "a model without MoE layers takes the whole-step runner"
        self.experts = experts
        cfg = model.config
        dtype = model.lm_head.weight.dtype
        n, device, k, hidden = self.max_batch, self.device, self.top_k, self.hidden_size
        # The router's outputs and the CPU sum between the spans.
        self.h_moe = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.topk_ids = torch.zeros(n, k, dtype=torch.int64, device=device)
        self.topk_weights = torch.zeros(n, k, dtype=dtype, device=device)
        self.cpu_out = torch.zeros(n, cfg.hidden_size, dtype=torch.float32, device=device)
        # The mailbox for `forward_staged`, on the device and pinned on the host: bytes per token in the driver's
        # layout (`mail_views`).
        self.driven = experts if isinstance(experts, DrivenExpertBackend) else None
        if self.driven is not None:
            self.mail_row = mail_layout(1, k, hidden)[2]
            self.mail = torch.zeros(n * self.mail_row, dtype=torch.uint8, device=device)
            self.host = PinnedBuffers(pin=device.type == "cuda")
            self.mail_host = self.host.get("mail", (n * self.mail_row,), torch.uint8)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if use_graphs:
            self._capture()

    def _expert_sum(self, size: int) -> torch.Tensor:
        return self.moe_out[:size] + self.cpu_out[:size].to(self.x_resid.dtype)

    def _span(self, size: int, index: int) -> None:
        """Span `index`, its router's outputs into the static buffers (and the device mailbox, when staged)."""
        routed = self._route(size, index)
        if routed is None:
            return
        h, ids, weights = routed
        self.h_moe[:size].copy_(h)
        self.topk_ids[:size].copy_(ids)
        self.topk_weights[:size].copy_(weights)
        if self.driven is not None:
            mail_ids, mail_weights, mail_hidden = mail_views(self.mail, size, self.top_k, self.hidden_size)
            mail_ids.copy_(ids)
            mail_weights.copy_(weights)
            mail_hidden.copy_(h)

    @torch.inference_mode()
    def _capture(self) -> None:
        self._pad_from(0)
        pool = None
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            graphs = []
            for index in range(len(self.spans)):
                self._span(size, index)  # compiles kernels and warms the allocator outside the capture
                torch.cuda.synchronize()
                graph, pool, _ = _capture(partial(self._span, size, index), pool)
                graphs.append(graph)
            self.graphs[size] = graphs
        self._log_captured()

    def _step(self, size: int, batch: int) -> torch.Tensor:
        graphs = self.graphs.get(size)
        driven = self.driven  # one backend serves every MoE layer
        h, weights, out = self.h_moe[:batch], self.topk_weights[:batch], self.moe_out[:batch]
        if driven is not None:
            mail, mail_host = self.mail[: size * self.mail_row], self.mail_host[: size * self.mail_row]
            views = mail_views(self.mail_host, size, self.top_k, self.hidden_size)
            host_ids, host_weights, host_hidden = (v[:batch] for v in views)
        for index, (_, moe_layer) in enumerate(self.spans):
            if graphs is not None:
                graphs[index].replay()
            else:
                self._span(size, index)
            if moe_layer < 0:
                continue
            # The routed experts of the real rows, eagerly (host sync, copies, CPU work).
            if driven is not None:
                mail_host.copy_(mail, non_blocking=True)
                driven.forward_staged(
                    moe_layer, h, weights, host_ids, host_weights, host_hidden, out=out, cpu_out=self.cpu_out
                )
            else:
                out.copy_(self.experts.forward(moe_layer, h, self.topk_ids[:batch], weights))
        return self.logits[:batch]
