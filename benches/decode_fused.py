"""Decode throughput with every weight on the GPU (`--moe-backend fused`), at real shapes with dummy weights.

The ceiling the offloading backends are measured against. Default: the real Qwen3-30B-A3B config (48 layers, 128
experts, top-8, bf16: ~61 GB of weights), batch 1 and 8.

    python benches/decode_fused.py [--preset qwen3-30b-a3b] [--batch 1 8] [--prompt-len 128] [--decode-steps 64]
                                   [--align kernel ops]

--align times the MoE layers' pair alignment (`fused_moe.align_pairs`) as one Triton program (`kernel`, the default
on CUDA) and as tensor ops (`ops`): an engine each (its decode graphs are captured at its start), same weights.
Prints one line per batch size and alignment (median step time, tok/s) and a final JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.kernels import fused_moe
from freetoken.models.loader import init_dummy_weights
from freetoken.models.presets import preset_config_path
from freetoken.moe import FusedExperts


def measure(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> list[float]:
    """Per-step wall times (s) of `steps` decode steps of `batch` requests after their prefill."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, engine.model_cfg.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"b{batch}-{i}", prompt, params)
    engine.step()  # prefill of all prompts (one chunk), samples the first token
    times = []
    while engine.has_work():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def profile(engine: LLMEngine) -> None:
    """Print the ops that take the most CPU and GPU time over a few batch-1 decode steps (to stderr)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("profile", list(range(1, 65)), params)
    engine.step()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while engine.has_work():
            engine.step()
        torch.cuda.synchronize()
    for key in ("self_cpu_time_total", "self_cuda_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=15), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="print the torch profiler's top ops of 4 decode steps")
    ap.add_argument(
        "--align",
        nargs="+",
        choices=["kernel", "ops"],
        default=["kernel"],
        help="the pair alignment: one Triton program (kernel) or tensor ops (ops), each a row",
    )
    args = ap.parse_args()
    cfg = ModelConfig.from_dict(json.loads(preset_config_path(args.preset).read_text()), source=args.preset)
    device = torch.device("cuda")
    t0 = time.perf_counter()
    experts = FusedExperts()
    model = init_dummy_weights(cfg, experts, device, torch.bfloat16, seed=0)
    build_s = time.perf_counter() - t0
    engine_cfg = EngineConfig(
        device="cuda",
        dtype="bfloat16",
        moe_backend="fused",
        max_num_seqs=max(args.batch),
        kv_cache_gb=4.0,
        max_model_len=4096,
    )
    weights_gb = (sum(p.numel() * p.element_size() for p in model.parameters()) + experts.nbytes) / 1e9
    print(
        f"{args.preset}: {weights_gb:.1f} GB of weights on {torch.cuda.get_device_name()} (built in {build_s:.0f} s)",
        file=sys.stderr,
    )
    rows = []
    kernel_max_pairs = fused_moe.ALIGN_KERNEL_MAX_PAIRS
    for align in args.align:
        fused_moe.ALIGN_KERNEL_MAX_PAIRS = kernel_max_pairs if align == "kernel" else 0
        torch.cuda.reset_peak_memory_stats()  # each engine's peak alone (the previous one is freed below)
        engine = LLMEngine(model, cfg, engine_cfg, tokenizer=None)
        measure(engine, 1, 16, 4)  # warm-up
        if args.profile:
            profile(engine)
        for batch in args.batch:
            times = measure(engine, batch, args.prompt_len, args.decode_steps)
            step_s = statistics.median(times)
            rows.append(
                {
                    "batch": batch,
                    "align": align,
                    "step_ms": round(step_s * 1e3, 2),
                    "tok_per_s": round(batch / step_s, 1),
                    "steps": len(times),
                    "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1),
                }
            )
            print(
                f"batch {batch:3d}, align {align:>6}: median step {step_s * 1e3:7.2f} ms  "
                f"decode {batch / step_s:8.1f} tok/s"
            )
        del engine  # its KV cache and graphs, before the next engine allocates its own
        gc.collect()
        torch.cuda.empty_cache()
    fused_moe.ALIGN_KERNEL_MAX_PAIRS = kernel_max_pairs
    print(
        json.dumps(
            {
                "bench": "decode_fused",
                "model": args.preset,
                "backend": "fused",
                "dtype": "bfloat16",
                "weights_gb": round(weights_gb, 1),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
