"""A prefill chunk's per-layer compute at the shapes of the agent trace's turns: attention alone as the engine runs
it (`freetoken.models.attention.paged_attention`) with each set of SDPA backends it may use, and the MoE kernel
alone (`fused_moe` over every expert of a layer resident, the routing uniform) under several launch configs.

An 18.8k-token cold first turn took 1.94-2.03 s to its first token through `ft serve` on the H200 box, and the
server's calibration measured its streamed forward at 1.84x the copy time (~1.87 s: ~39 ms per layer, where the
copies take ~21), while a 10.6k-token extend over a 32.8k-token prefix answered in 1.20 s. Measured here (H200):
per layer, the cold prompt's attention took 4.6 ms on cuDNN (torch's own choice) and 8.7 on flash, the extend's
19.7 on flash; the MoE kernel 5.9 ms at 18816 tokens (241 TFLOP/s): ~15 ms of compute, under the copies. What the
steady-state timings leave out is the first call at a new shape, which a cold prompt always is: `first_call_ms`
(wall time, compiles and cuDNN graph builds included) is that cost, per backend set (each row at a shape of its
own). Backend sets: `engine` (what paged_attention uses now: no cuDNN), `torch` (all of them, cuDNN included:
what it used before), `flash`, `cudnn`.

    python benches/prefill_compute.py [--preset qwen3-30b-a3b] [--cases 18816:18816 10638:43486 2048:32768]

Prints one line per (case, backend set) and per (MoE size, launch config): ms per layer, s per forward (x the
model's layers), the first call's ms and the top kernel (attention) or TFLOP/s (MoE); then a JSON line. Needs CUDA
(a few GB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

from freetoken.config import ModelConfig
from freetoken.kernels.fused_moe import fused_moe
from freetoken.models import attention
from freetoken.models.attention import AttentionMetadata, paged_attention
from freetoken.models.presets import preset_config_path

BLOCK = 16
# What `paged_attention` may use for prefill spans (`attention.PREFILL_SDPA_BACKENDS`, set per row): the engine's
# list, torch's own choice among all of them (cuDNN included), or one backend.
BACKENDS = {
    "engine": attention.PREFILL_SDPA_BACKENDS,
    "torch": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


def time_case(cfg: ModelConfig, qlen: int, ctx: int, backends, repeats: int) -> tuple[float, float, str]:
    """(median seconds of one layer's prefill attention of `qlen` queries over `ctx` tokens with `backends`
    allowed, wall seconds of the first call at this shape, the top device kernel by time); raises RuntimeError when
    the backends cannot run it."""
    device = torch.device("cuda")
    blocks = list(range(-(-ctx // BLOCK)))
    k_cache = torch.randn(len(blocks) * BLOCK, cfg.num_key_value_heads, cfg.head_dim, device=device).bfloat16()
    v_cache = torch.randn_like(k_cache)
    meta = AttentionMetadata.build([qlen], [ctx], [blocks], BLOCK, device)
    q = torch.randn(qlen, cfg.num_attention_heads, cfg.head_dim, device=device).bfloat16()
    k = torch.randn(qlen, cfg.num_key_value_heads, cfg.head_dim, device=device).bfloat16()
    v = torch.randn_like(k)
    scale = cfg.head_dim**-0.5

    def run() -> None:
        paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    engine = attention.PREFILL_SDPA_BACKENDS
    attention.PREFILL_SDPA_BACKENDS = backends
    try:
        seconds, first = median_seconds(run, repeats)  # its first call raises when the backends cannot run it
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
    finally:
        attention.PREFILL_SDPA_BACKENDS = engine
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    top = max(events, key=lambda e: e.self_device_time_total).key if events else "?"
    return seconds, first, top


def median_seconds(fn, repeats: int) -> tuple[float, float]:
    """(median device seconds of `fn()` over `repeats` calls (CUDA events) after a first call, wall seconds of
    that first call: compiles, graph builds)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), first


def time_moe(cfg: ModelConfig, tokens: int, repeats: int, config: tuple[int, int, int, int]) -> float:
    """Median seconds of `fused_moe` (launch `config`) over `tokens` tokens routed uniformly at random among a
    layer's experts, all resident (the streamed path's kernel, with the alignment computed in the call)."""
    device = torch.device("cuda")
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    gate_up = torch.randn(e, 2 * inter, hidden, device=device).bfloat16() * 0.02
    down = torch.randn(e, hidden, inter, device=device).bfloat16() * 0.02
    x = torch.randn(tokens, hidden, device=device).bfloat16()
    ids = torch.rand(tokens, e, device=device).topk(k, dim=1).indices
    weights = torch.full((tokens, k), 1.0 / k, device=device)
    return median_seconds(lambda: fused_moe(x, gate_up, down, ids, weights, config=config), repeats)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["18816:18816", "10638:43486", "2048:32768"],
        help="QUERIES:CONTEXT (queries = context: a cold prompt)",
    )
    ap.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=["engine", "torch", "flash", "cudnn"])
    ap.add_argument("--moe-tokens", type=int, nargs="*", default=[2048, 10638, 18816], help="MoE kernel sizes")
    ap.add_argument(
        "--moe-configs",
        nargs="*",
        default=["64,64,4,3", "128,64,4,3", "128,64,8,3", "128,64,8,4", "64,64,8,4"],
        help="MoE launch configs BLOCK_N,BLOCK_K,warps,stages (the first is the kernel's LAUNCH_CONFIG)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(json.loads(preset_config_path(args.preset).read_text()), source=args.preset)
    layers = cfg.num_hidden_layers
    rows = []
    for case in args.cases:
        qlen0, ctx0 = (int(x) for x in case.split(":"))
        for i, name in enumerate(args.backends):
            # A shape of its own per backend (one token more each): its first call meets no graph another built.
            qlen, ctx = qlen0 + i, ctx0 + i
            try:
                seconds, first, top = time_case(cfg, qlen, ctx, BACKENDS[name], args.repeats)
            except RuntimeError as e:  # the forced backend cannot take these inputs
                print(f"queries={qlen} context={ctx} backend={name}: cannot run ({str(e).splitlines()[0]})")
                continue
            row = {
                "queries": qlen,
                "context": ctx,
                "backend": name,
                "ms_per_layer": round(seconds * 1e3, 2),
                "s_per_forward": round(seconds * layers, 3),
                "first_call_ms": round(first * 1e3, 1),
                "top_kernel": top[:80],
            }
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    for tokens in args.moe_tokens:
        for text in args.moe_configs:
            config = tuple(int(v) for v in text.split(","))
            try:
                seconds = time_moe(cfg, tokens, args.repeats, config)
            except Exception as e:  # a config Triton cannot compile (shared memory): say so, go on
                print(f"moe_tokens={tokens} config={text}: failed ({str(e).splitlines()[0][:120]})")
                continue
            flops = tokens * cfg.num_experts_per_tok * 6 * cfg.hidden_size * cfg.moe_intermediate_size
            row = {
                "moe_tokens": tokens,
                "config": text,
                "ms_per_layer": round(seconds * 1e3, 2),
                "s_per_forward": round(seconds * len(cfg.moe_layers), 3),
                "tflops": round(flops / seconds / 1e12, 1),
            }
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    print(json.dumps({"bench": "prefill_compute", "model": args.preset, "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
