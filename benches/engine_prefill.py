"""Prompt prefill through the whole engine, as `ft serve` builds it, for any model: tokens/s by prompt length, the
expert backend's strategy per chunk, and where the time goes.

`benches/prefill.py` times the expert path of Qwen3-30B-A3B's layers alone; this one runs `LLMEngine.from_dir` with
`ft serve`'s own flags (`--serve-args`, every `EngineConfig` field), so a hybrid model's token mixers (Qwen3.5's
Gated DeltaNet), its state pool and checkpoints, the scheduler's chunking and the sampler are all in the time. Each
prompt is fresh (a random nonce first, so the prefix cache holds nothing of it) and asks for one token: its wall
time is the engine's TTFT without HTTP. Per length, `--repeats` prompts (the median counts; the first of a length
compiles its kernels and is reported apart as `first_s`).

`--profile` runs one more prompt of the longest length under the torch profiler and prints the top ops by device
time and by host time, and the device time summed by kind (`KINDS`: the Gated DeltaNet kernels, the expert kernels,
host-to-device copies, attention, the other matmuls), beside the prompt's wall time: what the device was busy with,
and how much of the wall it was not.

    # on the GPU box (Qwen3.5-35B-A3B real config, dummy weights, the synthetic routing trace, 24 GB)
    python benches/engine_prefill.py --model qwen3.5-35b-a3b --prompts 2048 8192 18944 --profile \\
        --serve-args "--device cuda --dummy-weights --replay-routing synthetic --gpu-memory-gb 24 --max-model-len 70000"
    # on the CPU, the demo model (seconds)
    python benches/engine_prefill.py --model demo --prompts 64 256 --serve-args "--device cpu --dummy-weights"

Prints one line per length, the profile tables, and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time

import numpy as np
import torch

from freetoken.cli.serve import DEMOS, add_engine_args, engine_config, resolve_model_dir
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams

# Device-time kinds of `--profile`, by substrings of kernel names (first match wins; the rest is "other").
KINDS = {
    "gated_delta": ("_chunk_prepare", "_chunk_scan", "_recurrent_kernel", "conv"),
    "experts": ("fused_moe", "_gate_up", "_down", "moe_align", "swiglu"),
    "copy_h2d": ("Memcpy HtoD", "memcpy32_post", "Memcpy PtoP"),
    "attention": ("attention", "flash", "fmha", "_paged"),
    "gemm": ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas"),
}


def kind_of(name: str) -> str:
    """`KINDS`' key whose substring `name` contains (case-insensitive), else "other"."""
    low = name.lower()
    return next((kind for kind, subs in KINDS.items() if any(s.lower() in low for s in subs)), "other")


def prefill_once(engine: LLMEngine, length: int, rng: np.random.Generator, vocab: int, tag: str) -> float:
    """Seconds from queueing a fresh `length`-token prompt to its first token (one token asked for)."""
    tokens = rng.integers(1, vocab, length).tolist()
    engine.add_request(tag, tokens, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    sync()
    return time.perf_counter() - start


def strategy_counts(engine: LLMEngine) -> dict[str, int]:
    """The expert backend's prefill chunks per strategy so far ({} for a backend without prefill counters)."""
    prefill = engine.experts.stats().get("prefill") or {}
    return dict(prefill.get("steps_by_strategy", {}))


def profile_prompt(engine: LLMEngine, length: int, rng: np.random.Generator, vocab: int, log) -> dict:
    """One prompt under the torch profiler: top ops logged; returns device seconds by kind and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        wall = prefill_once(engine, length, rng, vocab, "profiled")
    events = prof.key_averages()
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    for key in (device_key, "self_cpu_time_total"):
        log(events.table(sort_by=key, row_limit=20, max_name_column_width=60))
    by_kind: dict[str, float] = {}
    cuda = torch.cuda.is_available()
    for event in events:
        # Device-side events only (kernels, copies): an op's own row repeats its kernels' device time.
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        seconds = (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e6
        if seconds > 0:
            by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0.0) + seconds
    return {"wall_s": round(wall, 3), **{k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory, a preset (with --dummy-weights) or a demo")
    ap.add_argument("--serve-args", default="", help="`ft serve` flags (one string), e.g. --device cuda ...")
    ap.add_argument("--prompts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=2, help="timed prompts per length after the first (median)")
    ap.add_argument("--profile", action="store_true", help="profile one more prompt of the longest length")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    serve = argparse.ArgumentParser(prog="--serve-args", add_help=False)
    add_engine_args(serve)
    try:
        cfg = engine_config(serve.parse_args(shlex.split(args.serve_args)))
    except SystemExit:
        ap.error(f"--serve-args: not `ft serve` engine flags: {args.serve_args!r}")
    if args.model in DEMOS and not cfg.kv_cache_tokens:
        cfg.kv_cache_tokens = 2 * max(args.prompts) + 64
    if max(args.prompts) >= (cfg.max_model_len or 1 << 30):
        ap.error(f"--prompts: {max(args.prompts)} tokens do not fit --max-model-len {cfg.max_model_len}")
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine.from_dir(resolve_model_dir(args.model, cfg.dummy_weights), cfg)
    log(f"engine built in {time.perf_counter() - t0:.0f} s; routing {engine.routing}")
    vocab = min(engine.model_cfg.vocab_size, 100_000)
    rng = np.random.default_rng(args.seed)
    rows = []
    for length in args.prompts:
        before = strategy_counts(engine)
        first = prefill_once(engine, length, rng, vocab, f"first-{length}")
        times = [prefill_once(engine, length, rng, vocab, f"p{length}-{i}") for i in range(args.repeats)]
        after = strategy_counts(engine)
        median = statistics.median(times) if times else first
        row = {
            "prompt": length,
            "first_s": round(first, 3),
            "median_s": round(median, 3),
            "tok_per_s": round(length / median),
            "times_s": [round(t, 3) for t in times],
            "chunks_by_strategy": {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)},
        }
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    out = {"model": args.model, "serve_args": args.serve_args, "rows": rows}
    if args.profile:
        out["profile"] = profile_prompt(engine, max(args.prompts), rng, vocab, log)
        print("profile (device seconds by kind): " + json.dumps(out["profile"]), flush=True)
    out["prefill_stats"] = engine.experts.stats().get("prefill")
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
