"""The device side of the decode driver's handshake: a decode step's MoE layers served from a host thread while
the whole step runs as one CUDA graph.

The protocol (the flags, their order, what each side writes) is written once, in the module doc of
`rust/freetoken-core/src/driver/mod.rs`; the Rust `DecodeDriver` serves each layer through the same `LayerServer` as
eager steps. This module is the device's side: `_post_mail` writes the routing into the mapped host mailbox and raises
the mail flag, `_wait_fetch` spins on the plan, fill and CPU flags and copies (or adds) what the driver wrote.
Compared with a host sync per layer (the piecewise graphs) this removes, per layer, a graph
launch, a stream synchronisation and the Python of the plan, the fills and the kernel launches: on the H200 box,
Qwen3-30B-A3B at a 24 GB budget, batch 1, a hybrid decode step went from 47-66 ms (piecewise) to 36.5 ms, and to
25-27 ms once the CPU experts started before the fills on workers that keep a core free, the plan flag followed the
fills and the layer's small ops were fused, and 23.5 ms with the q/k norms, RoPE and the KV write in one kernel and
the residual adds in the norms (benches/moe_backends.py). Writing the mailbox from the kernel, instead of packing it
on the device and copying it and then the flag, takes two copy nodes (about 10 us of latency between the router and
the host seeing the flag, in a profile) off each MoE layer. Running the hits' tiles while the fills cross PCIe
leaves only the filled experts' share of the slot kernel after the last fill lands (in a profile the whole slot
kernel took about 30 us there, and 20 us more passed from the fill landing to its start); side by side with the old
order the driver's wait for the next post fell by 0.4-0.6 ms a step, within the noise of the step's tok/s.

A spin that outlasts `MAX_SPINS` polls (seconds) gives up so a wedged driver cannot hang the GPU: it marks the
layer in a fifth flag row, and `finish` raises for the step (whose output is then wrong).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

from freetoken._core import DecodeDriver, HandshakeBuffers, LayerServer, StepReport, aligned_len, mail_layout
from freetoken.errors import FreetokenError
from freetoken.moe.pinned import PinnedBuffers

if TYPE_CHECKING:
    from freetoken._core import _Backend

MAX_SPINS = 20_000_000  # polls of a host flag over PCIe (~1 us each): the device gives up after seconds
FETCH_BLOCK = 1024


class DriverGaveUpError(FreetokenError, RuntimeError):
    """The device stopped waiting for the decode driver at some layer (after `MAX_SPINS` polls): the step's output
    is wrong."""


def mail_views(
    buf: torch.Tensor, size: int, top_k: int, hidden: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of mailbox `buf` (uint8) for a padded batch of `size` rows: ids [size, k] int64, routing weights
    [size, k] float32 and hidden states [size, H] float32, packed one after the other from byte 0 (the layout the
    driver reads, from the driver itself: `mail_layout`), so one copy moves them all."""
    a, b, c = mail_layout(size, top_k, hidden)
    return (
        buf[:a].view(torch.int64).view(size, top_k),
        buf[a:b].view(torch.float32).view(size, top_k),
        buf[b:c].view(torch.float32).view(size, hidden),
    )


@triton.jit
def _post_mail(
    ids_ptr,
    w_ptr,
    h_ptr,
    mail_ids_ptr,
    mail_w_ptr,
    mail_h_ptr,
    arrived_ptr,
    flag_ptr,
    gen_ptr,
    hidden,
    stride_ids,
    stride_w,
    stride_h,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One row of the mailbox, written straight into mapped host memory: its ids, routing weights and hidden state
    (as float32). The last program to finish raises the layer's mail flag to this step's generation.

    Ordering: each program's stores come before its arrival (a CTA barrier, then an acquire-release atomic at
    system scope on the device counter `arrived_ptr`); the last to arrive has acquired every row, resets the
    counter for the next layer and writes the flag with a system-scope release, so a host that sees the flag
    (an Acquire load) sees the whole mailbox: the last-block pattern of the CUDA programming guide's
    `__threadfence` example, with the fence at system scope as for any host-visible flag."""
    row = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    ok = kk < TOP_K
    tl.store(mail_ids_ptr + row * TOP_K + kk, tl.load(ids_ptr + row * stride_ids + kk, mask=ok), mask=ok)
    weights = tl.load(w_ptr + row * stride_w + kk, mask=ok).to(tl.float32)
    tl.store(mail_w_ptr + row * TOP_K + kk, weights, mask=ok)
    for start in range(0, hidden, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        okh = offs < hidden
        h = tl.load(h_ptr + row * stride_h + offs, mask=okh).to(tl.float32)
        tl.store(mail_h_ptr + row * hidden + offs, h, mask=okh)
    tl.debug_barrier()
    if tl.atomic_add(arrived_ptr, 1, sem="acq_rel", scope="sys") == tl.num_programs(0) - 1:
        tl.store(arrived_ptr, 0)
        tl.atomic_xchg(flag_ptr, tl.load(gen_ptr), sem="release", scope="sys")


@triton.jit
def _wait_fetch(
    flag_ptr, gen_ptr, src_ptr, dst_ptr, gave_up_ptr, n, max_spins, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr
):
    """Spin until the host flag equals this step's generation, then copy n elements host -> device (or, with
    ACCUMULATE, add them to the destination, in float32, rounded to its dtype); a program that gives up after
    `max_spins` polls writes the generation to `gave_up_ptr` (host).

    Every program polls the flag itself (volatile loads go to host memory each time), so no grid-wide barrier
    is needed; the copy is split over the programs."""
    want = tl.load(gen_ptr)
    seen = tl.load(flag_ptr, volatile=True)
    spins = 0
    while (seen != want) & (spins < max_spins):
        seen = tl.load(flag_ptr, volatile=True)
        spins += 1
    if seen != want:
        tl.store(gave_up_ptr, want)
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        val = tl.load(src_ptr + offs, mask=ok, volatile=True)
        if ACCUMULATE:
            val = tl.load(dst_ptr + offs, mask=ok).to(tl.float32) + val.to(tl.float32)
        tl.store(dst_ptr + offs, val.to(dst_ptr.dtype.element_ty), mask=ok)


def _fetch(
    flag: torch.Tensor,
    gen: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    gave_up: torch.Tensor,
    accumulate: bool = False,
):
    n = dst.numel()
    # A program per block: each block's loads cross PCIe once, in parallel (the sum of batch 1 is two blocks).
    grid = (max(1, min(64, triton.cdiv(n, FETCH_BLOCK))),)
    _wait_fetch[grid](flag, gen, src, dst, gave_up, n, MAX_SPINS, BLOCK=FETCH_BLOCK, ACCUMULATE=accumulate)


class DeviceHandshake:
    """Buffers, driver and device-side calls of the handshake, for decode batches of up to `max(sizes)` rows.

    Args:
        server: the Rust `LayerServer` that serves each layer (planner, CPU experts, the copier into `slots`).
        mode: the planner mode it plans with ("offload", "cpu", "hybrid").
        slots: [rows, expert_stride] uint8, the device slots the slot kernel reads (the handshake's device too).
        moe_layers: model layer index of each pool layer (`ExpertPool.moe_layers`); hidden: H; top_k: k.
        sizes: padded batch sizes that will be captured (each gets its plan layout); the largest sizes the buffers.
        timeout_s: how long the driver waits for the device to post a layer before failing the step.
    """

    def __init__(
        self,
        server: LayerServer,
        mode: _Backend,
        slots: torch.Tensor,
        moe_layers: list[int],
        hidden: int,
        top_k: int,
        sizes: list[int],
        timeout_s: float = 10.0,
    ) -> None:
        from freetoken.kernels.fused_moe import block_m_for

        self.top_k, self.hidden = top_k, hidden
        self.block_m = {s: block_m_for(s * top_k) for s in sizes}
        max_batch = max(sizes)
        self.slot_rows = slots.shape[0]
        self.pool_layer = {model_layer: i for i, model_layer in enumerate(moe_layers)}
        device, k, layers = slots.device, top_k, len(moe_layers)
        self.layout = {s: self._layout(s) for s in sizes}
        plan_len = max(ns + nr + 2 * nt for ns, nr, nt in self.layout.values())
        self.host = PinnedBuffers(pin=True)
        # Rows: mail (device -> driver), plan, fill and cpu (driver -> device), gave up (device, on a failed wait).
        self.flags = self.host.get("flags", (5, layers), torch.int32)
        self.flags.zero_()
        self.mail = self.host.get("mail", (mail_layout(max_batch, k, self.hidden)[2],), torch.uint8)
        self.plan = self.host.get("plan", (plan_len,), torch.int64)
        self.cpu_out = self.host.get("cpu_out", (max_batch * self.hidden,), torch.float32)
        self.plan_dev = torch.zeros(plan_len, dtype=torch.int64, device=device)
        self.arrived = torch.zeros(1, dtype=torch.int32, device=device)  # rows of the mailbox written (`_post_mail`)
        self.gen = torch.zeros(1, dtype=torch.int32, device=device)
        self.generation = 0
        self._in_step = False  # between start and a successful finish; the device's counter may be off
        flags = self.flags.numpy().view(np.uint32)
        buffers = HandshakeBuffers(
            mail_flag=flags[0],
            plan_flag=flags[1],
            fill_flag=flags[2],
            cpu_flag=flags[3],
            mail=self.mail.numpy(),
            plan=self.plan.numpy(),
            cpu_out=self.cpu_out.numpy(),
        )
        self.driver = DecodeDriver(server, buffers, mode, k, timeout_s=timeout_s)

    def _layout(self, size: int) -> tuple[int, int, int]:
        rows, tiles = aligned_len(size * self.top_k, self.slot_rows, self.block_m[size])
        return size * self.top_k, rows, tiles

    # -- host side, around one replay -------------------------------------------------------------------------

    def start(self, batch: int, size: int, idle: bool = False) -> None:
        """Hand the step to the driver thread; then run the graph (or the eager step) of `size` rows."""
        if self._in_step:  # the last step failed somewhere: set the device's counter to the host's again
            self.gen.fill_(self.generation)
        self._in_step = True
        self.driver.start(batch, size, self.generation + 1, self.block_m[size], idle)
        self.generation += 1

    def wait_served(self, layer: int) -> None:
        """Block (GIL released) until the driver has served model layer `layer` of the running step."""
        self.driver.wait_served(self.pool_layer[layer], self.generation)

    def finish(self) -> StepReport:
        """Wait for the driver to serve every layer (GIL released); its report. Raises the driver's error (a
        plan that failed; a device that never posted, `DeviceTimeoutError` with its `layer` and `step`; the driver
        has released every layer, so the device runs the step to its end) or, when the device gave up waiting for a
        layer, a `DriverGaveUpError`. After an error the step's fills may have moved slots: the caller tells the
        backend (`DrivenExpertBackend.after_failed_driven_step`)."""
        report = self.driver.finish()
        gave_up = np.flatnonzero(self.flags[4].numpy() == self.generation)
        if gave_up.size:
            raise DriverGaveUpError(
                f"decode step {self.generation}: the device stopped waiting for the driver at pool layer(s) "
                f"{gave_up.tolist()} after {MAX_SPINS} polls; the step's output is wrong"
            )
        self._in_step = False
        return report

    # -- device side, recorded into the graph ---------------------------------------------------------------

    def begin(self) -> None:
        """First op of the step: a new generation."""
        self.gen.add_(1)

    def post(self, layer: int, ids: torch.Tensor, weights: torch.Tensor, hidden: torch.Tensor) -> None:
        """Write the layer's routing (ids [size, k] int64, weights [size, k] and hidden states [size, H], rows
        contiguous in the last dim) into the host mailbox and raise its flag, in one kernel (`_post_mail`)."""
        index = self.pool_layer[layer]
        size = ids.shape[0]
        mail_ids, mail_weights, mail_hidden = mail_views(self.mail, size, self.top_k, self.hidden)
        _post_mail[(size,)](
            ids,
            weights,
            hidden,
            mail_ids,
            mail_weights,
            mail_hidden,
            self.arrived,
            self.flags[0, index:],
            self.gen,
            self.hidden,
            ids.stride(0),
            weights.stride(0),
            hidden.stride(0),
            TOP_K=self.top_k,
            BLOCK_K=triton.next_power_of_2(self.top_k),
            BLOCK_H=min(triton.next_power_of_2(self.hidden), 4096),
        )

    def fetch_plan(self, layer: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Wait for the layer's plan and bring it to the device: (topk slots [size, k], sorted pairs, tile slots
        [2, tiles]: row 0 the hits' tiles, row 1 the filled slots', -1 elsewhere), int64 views of a device buffer,
        what `fused_moe_tiles` takes. Row 1 may be run only after `wait_fills`."""
        index = self.pool_layer[layer]
        ns, nr, nt = self.layout[size]
        dev = self.plan_dev[: ns + nr + 2 * nt]
        _fetch(self.flags[1, index:], self.gen, self.plan, dev, self.flags[4, index:])
        return dev[:ns].view(size, self.top_k), dev[ns : ns + nr], dev[ns + nr :].view(2, nt)

    def wait_fills(self, layer: int) -> None:
        """Wait until the layer's fills have landed in their slots (the fill flag)."""
        index = self.pool_layer[layer]
        _fetch(self.flags[2, index:], self.gen, self.plan, self.plan_dev[:0], self.flags[4, index:])

    def fetch_cpu(self, layer: int, size: int, out: torch.Tensor) -> None:
        """Wait for the layer's CPU experts and add their float32 sum [size, H] into `out` (device, contiguous)."""
        index = self.pool_layer[layer]
        _fetch(
            self.flags[3, index:],
            self.gen,
            self.cpu_out,
            out.view(-1)[: size * self.hidden],
            self.flags[4, index:],
            accumulate=True,
        )
