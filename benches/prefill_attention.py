"""Prefill attention alone, as the engine runs it (`freetoken.models.attention.paged_attention`), at the shapes of the
agent trace's turns, per SDPA backend: does a cold prompt (queries = context: `is_causal=True`, torch's own backend
choice) cost more per layer than an extend over a cached prefix (lower-right causal mask: the flash kernel called
directly by `torch.nn.attention.bias.CausalBias`)?

An 18.8k-token cold first turn took 1.94-2.03 s to its first token through `ft serve` on the H200 box, a 10.6k-token
extend over a 32.8k-token prefix 1.20 s, though the extend attends over more (query, key) pairs. Streaming the
experts (~1.0 s per chunk at that budget) hides compute up to ~21 ms per layer; this says how much of the rest the
attention of each kind is, and which kernel torch picks for it (the top device kernel under the profiler).

    python benches/prefill_attention.py [--preset qwen3-30b-a3b] [--cases 18816:18816 10638:43486 2048:32768]

Prints one line per (case, backend): ms per layer, s per forward (x the model's layers), the top kernel; then a JSON
line. Needs CUDA (a few GB).
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

    run()  # warm-up (and a backend that cannot take the case raises here)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    top = max(events, key=lambda e: e.self_device_time_total).key if events else "?"
    return statistics.median(times), top


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
    print(json.dumps({"bench": "prefill_attention", "model": args.preset, "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
