"""Measure the activation memory of one prefill step without a GPU: the bytes of the tensors that the step's ops
allocate, while they live (`LiveBytes`), through the CUDA code path of the models.

`cuda_path_on` makes a device ("cpu" or "meta") take what CUDA takes: the Triton kernels of `freetoken.kernels` (in
Triton's interpreter on the CPU; on "meta" their launches do nothing: the launchers' allocations, which are what is
measured, still happen), the fused q/k/v projection, the decode rows of a mixed step through the Triton decode kernel,
and scaled dot-product attention as flash attention (what `PREFILL_SDPA_BACKENDS` picks on CUDA: GQA without copies of
K/V, an output and a float32 log-sum-exp). On "meta" real shapes cost no memory and no time, so the real Qwen3-30B-A3B
prefill chunk of 32768 tokens is measured in seconds.

`measure_prefill_peak` runs the whole model (embeddings, every layer, final norm) and the LM head on the last
position of each sequence, as `ModelRunner.run` does, with `FusedExperts` for the routed experts (the grouped
kernel's `fused_moe`, as the expert cache's `stream` strategy runs it; `fill`/`hybrid` run the same kernel).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from freetoken.config import ModelConfig
from freetoken.models import attention, qwen3_5_moe, qwen3_moe
from freetoken.models.attention import AttentionMetadata
from freetoken.models.loader import model_class
from freetoken.moe import compute
from freetoken.moe.fused import FusedExperts


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create inside the mode, counted from creation until the storage is freed.

    An op output whose storage is one of the op's inputs' (a view, an in-place op) is not counted; anything
    allocated before the mode (weights, KV cache) is not either. `peak` is the most bytes live at once, `peak_op`
    the op that reached it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self._refs: dict[int, weakref.ref] = {}
        self._what: dict[int, str] = {}
        self.at_peak: list[str] = []  # what was live at the peak: "op shape dtype" per storage
        self.phase = ""  # set by the caller (module hooks): `phase_peaks` keeps the peak of each
        self.phase_peaks: dict[str, int] = {}
        self.phase_live: dict[str, list[str]] = {}  # what was live at each phase's peak

    def _free(self, key: int, nbytes: int, _ref: weakref.ref) -> None:
        self.live -= nbytes
        self._refs.pop(key, None)
        self._what.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._refs:
                continue
            nbytes = storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda r, key=key, nbytes=nbytes: self._free(key, nbytes, r))
            self.live += nbytes
            self._what[key] = f"{func} {tuple(t.shape)} {t.dtype} {nbytes / 1e6:.1f} MB"
            if self.live > self.phase_peaks.get(self.phase, 0):
                self.phase_peaks[self.phase] = self.live
                self.phase_live[self.phase] = list(self._what.values())
            if self.live > self.peak:
                self.peak, self.peak_op = self.live, str(func)
                self.at_peak = list(self._what.values())
        return out


class _NoLaunch:
    """A Triton kernel whose launches do nothing (tensors on "meta" have no memory to read)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _sdpa_as_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` with the allocations of CUDA's backends (module docstring); on the CPU the
    values are computed by torch's own op outside the count."""
    # Flash attention: the output and a float32 log-sum-exp. (Masked calls, the decodes of a mixed step, do not
    # happen on kernel devices: the Triton decode kernel reads the cache.)
    assert attn_mask is None or isinstance(attn_mask, CausalBias), "a masked SDPA call on a kernel device"
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
    del lse
    if query.device.type == "meta":
        return out
    with _unmeasured():
        real = _REAL_SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True)
    return out.copy_(real)


_REAL_SDPA = F.scaled_dot_product_attention


@contextlib.contextmanager
def _unmeasured() -> Iterator[None]:
    """Run without the innermost dispatch mode (the `LiveBytes` counting)."""
    from torch.utils._python_dispatch import _pop_mode_temporarily

    with _pop_mode_temporarily():
        yield


def _causal_lower_right(qlen: int, ctx: int) -> CausalBias:
    """`causal_lower_right`, made outside `LiveBytes` (a tensor subclass cannot be made under a dispatch mode; it
    holds two sizes, no memory)."""
    with _unmeasured():
        return causal_lower_right(qlen, ctx)


@contextlib.contextmanager
def cuda_path_on(device: str) -> Iterator[None]:
    """Make `device` ("cpu" or "meta") take the models' CUDA code path (module docstring)."""
    with pytest.MonkeyPatch.context() as mp:
        for module in (qwen3_moe, qwen3_5_moe, compute, attention):
            mp.setattr(module, "KERNEL_DEVICES", {"cuda", device})
        mp.setattr(F, "scaled_dot_product_attention", _sdpa_as_cuda)
        mp.setattr(attention, "causal_lower_right", _causal_lower_right)
        # Meta tensors share one data pointer (0), so `_stacked` cannot see that q/k/v are the stacked views.
        mp.setattr(qwen3_moe.Attention, "_stacked", lambda self: True)
        if device == "meta":
            import triton

            from freetoken.kernels import fused_moe, gated_delta, layer_ops, paged_attention

            for module in (fused_moe, gated_delta, layer_ops, paged_attention):
                for attr, value in vars(module).items():
                    if isinstance(value, triton.runtime.KernelInterface):  # jit, interpreted or autotuned
                        mp.setattr(module, attr, _NoLaunch())
        yield


@dataclass
class Peak:
    """One measured step: `nbytes` at the peak (the forward pass and the LM head), and the op that reached it."""

    nbytes: int
    op: str
    live: list[str]
    phases: dict[str, int]
    phase_live: dict[str, list[str]]


def measure_prefill_peak(
    cfg: ModelConfig,
    query_lens: list[int],
    context_lens: list[int],
    device: str = "meta",
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
) -> Peak:
    """The activation peak of one step of `cfg`'s model through the CUDA code path on `device`.

    Args:
        query_lens, context_lens: per sequence of the step, its tokens in the step (1: a decode) and its context
            after the step (the KV cache holds every context: its blocks are laid out one sequence after another).
        device: "meta" (real shapes, no values), "cpu" (small shapes: random weights, Triton's interpreter, which
            keeps kernel arguments alive past their launch: its peaks run high), or "cuda" (the allocator's peak;
            no phases).
    """
    gen = torch.Generator().manual_seed(0)
    with torch.device(device):
        model = model_class(cfg)(cfg).to(dtype)
    if device != "meta":
        model.model.rotary = qwen3_moe.RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta).to(device)
        for p in model.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    if not cfg.is_qwen3_5:
        for layer in model.model.layers:
            layer.self_attn.fuse_qkv()
    experts = FusedExperts()
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for layer in cfg.moe_layers:
        gate_up = torch.empty(e, 2 * inter, h, dtype=dtype, device=device)
        down = torch.empty(e, h, inter, dtype=dtype, device=device)
        if device != "meta":
            gate_up.normal_(0.0, 0.05)
            down.normal_(0.0, 0.05)
        experts.load_layer(layer, gate_up, down)
    model.attach_experts(experts)
    blocks = [-(-c // block_size) for c in context_lens]
    num_slots = (sum(blocks) + 1) * block_size
    kv_layers = cfg.full_attention_layers if cfg.is_qwen3_5 else range(cfg.num_hidden_layers)
    kv = [
        tuple(torch.zeros(num_slots, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device) for _ in "kv")
        for _ in kv_layers
    ]
    tables, first = [], 1  # block 0 is the null block
    for n in blocks:
        tables.append(list(range(first, first + n)))
        first += n
    # The decodes' block tables, as on CUDA.
    with cuda_path_on(device) if device != "cuda" else contextlib.nullcontext():
        meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, torch.device(device))
    if cfg.is_qwen3_5:
        from freetoken.engine.state_pool import RecurrentStatePool

        pool = RecurrentStatePool(cfg, len(query_lens), dtype, torch.device(device))
        model.attach_state(pool)
        # A host tensor: the prefill path reads the slots with .tolist(), which meta tensors cannot do.
        meta.state_slots = torch.arange(len(query_lens))
    ids = torch.randint(0, cfg.vocab_size, (sum(query_lens),), generator=gen).to(device)
    rows = torch.tensor(list(torch.tensor(query_lens).cumsum(0) - 1), device=device)
    if device == "cuda":  # the real thing: the allocator's peak above what the step found allocated
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, meta, kv)[rows])
            del logits
        torch.cuda.synchronize()
        return Peak(torch.cuda.max_memory_allocated() - base, "", [], {}, {})
    live = LiveBytes()
    hooks = _phase_hooks(model, live)
    with cuda_path_on(device), torch.inference_mode(), live:
        live.phase = "layer"
        hidden = model(ids, meta, kv)
        live.phase = "logits"
        logits = model.compute_logits(hidden[rows])
        del hidden, logits
    for hook in hooks:
        hook.remove()
    return Peak(live.peak, live.peak_op, live.at_peak, live.phase_peaks, live.phase_live)


def _phase_hooks(model: torch.nn.Module, live: LiveBytes) -> list:
    """Forward hooks that name `live.phase` after the part of a layer that runs: "attention", "linear_attention",
    "moe" (router and routed experts), "shared_expert"; "layer" between them (norms, residual adds)."""

    def enter(name: str):
        return lambda module, args: setattr(live, "phase", name)

    def leave(module, args, out):
        live.phase = "layer"

    hooks = []
    for layer in model.model.layers:
        parts = {"attention": "self_attn", "linear_attention": "linear_attn", "moe": "mlp"}
        modules = {name: getattr(layer, attr) for name, attr in parts.items() if hasattr(layer, attr)}
        if hasattr(layer.mlp, "shared_expert"):
            modules["shared_expert"] = layer.mlp.shared_expert
        for name, module in modules.items():
            hooks += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    return hooks
