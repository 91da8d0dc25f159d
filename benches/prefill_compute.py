"""A prefill chunk's per-layer compute at the shapes of the agent trace's turns: attention alone as the engine runs
it (`freetoken.models.attention.paged_attention`) per SDPA backend, and the MoE kernel alone (`fused_moe` over
every expert of a layer resident, the routing uniform). Does a cold prompt's attention (queries = context:
`is_causal=True`, torch's own backend choice) cost more than an extend's over a cached prefix (lower-right causal
mask: the flash kernel called directly by `torch.nn.attention.bias.CausalBias`), and how fast is the MoE kernel at
prefill sizes?

An 18.8k-token cold first turn took 1.94-2.03 s to its first token through `ft serve` on the H200 box, and the
server's calibration measured its streamed forward at 1.84x the copy time (~1.87 s: ~39 ms per layer, where the
copies take ~21), while a 10.6k-token extend over a 32.8k-token prefix answered in 1.20 s though it attends over
more (query, key) pairs. This says how much of a layer's compute the attention of each kind is, which kernel torch
picks for it (the top device kernel under the profiler), and the MoE kernel's rate.

    python benches/prefill_compute.py [--preset qwen3-30b-a3b] [--cases 18816:18816 10638:43486 2048:32768]

Prints one line per (case, backend) and per MoE size: ms per layer, s per forward (x the model's layers), the top
kernel (attention) or TFLOP/s (MoE); then a JSON line. Needs CUDA (a few GB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from freetoken.config import ModelConfig
from freetoken.kernels.fused_moe import fused_moe
from freetoken.models.attention import AttentionMetadata, paged_attention
from freetoken.models.presets import preset_config_path

BLOCK = 16
BACKENDS = {
    "default": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


def time_case(cfg: ModelConfig, qlen: int, ctx: int, backends, repeats: int) -> tuple[float, str]:
    """(median seconds of one layer's prefill attention of `qlen` queries over `ctx` tokens, the top device kernel
    by time); raises RuntimeError when the backends cannot run it."""
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
        if backends is None:
            paged_attention(q, k, v, k_cache, v_cache, meta, scale)
        else:
            with sdpa_kernel(backends):
                paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    seconds = median_seconds(run, repeats)  # its warm-up call raises when the backends cannot take the case
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    top = max(events, key=lambda e: e.self_device_time_total).key if events else "?"
    return seconds, top


def median_seconds(fn, repeats: int) -> float:
    """Median device seconds of `fn()` over `repeats` calls (CUDA events) after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


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
    return median_seconds(lambda: fused_moe(x, gate_up, down, ids, weights, config=config), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["18816:18816", "10638:43486", "2048:32768"],
        help="QUERIES:CONTEXT (queries = context: a cold prompt)",
    )
    ap.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
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
        qlen, ctx = (int(x) for x in case.split(":"))
        for name in args.backends:
            try:
                seconds, top = time_case(cfg, qlen, ctx, BACKENDS[name], args.repeats)
            except RuntimeError as e:  # the forced backend cannot take these inputs
                print(f"queries={qlen} context={ctx} backend={name}: cannot run ({str(e).splitlines()[0]})")
                continue
            row = {
                "queries": qlen,
                "context": ctx,
                "backend": name,
                "ms_per_layer": round(seconds * 1e3, 2),
                "s_per_forward": round(seconds * layers, 3),
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
