"""Stress diagnostic for the offload backend's driven decode under evictions (tests/engine/test_gpu.py
::test_offload_driven_graphs_equal_fused_under_evictions): on the H200 at 02:51 Qwen3-MoE's demo with 32 slots for its
64 experts parted from fused at decode step 3 once, while later runs were equal. This runs that model at several slot
counts, prefill strategies and batch sizes, each with the copy stream delayed at random (a background thread queues
sleep kernels on it, so fills land late in random layers: every read of a filled slot must wait for its fill) and,
in the last rounds, with every core but one busy (the driver thread gets preempted). After every step it checks that
each expert the planner counts resident is in its slot (`ExpertCacheBackend.stale_slots`), then compares the tokens
and log-probabilities with fused. One line per configuration; the exit status is 1 if any differs.

    PYTHONPATH=$PWD/python python benches/diag_evict_stress.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from freetoken.config import EngineConfig
from freetoken.engine.cuda_graph import DrivenGraphRunner
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import build_demo_checkpoint

PROMPTS = [
    [3, 17, 100, 42, 7, 8, 9, 200, 13],
    [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 5,
    list(range(1000, 1030)),
    [77, 78, 79, 80] * 6,
]
STEPS = 16
SLEEP_CYCLES = 400_000  # at most ~0.2 ms of a ~2 GHz clock per sleep kernel on the copy stream


class CopyStreamDelays:
    """While active, queue a sleep kernel of random length on `stream` every 0-0.3 ms (from a thread of its own),
    so whatever the driver queues behind it (a layer's fills and their fill flag) lands late."""

    def __init__(self, stream: torch.cuda.Stream, seed: int) -> None:
        self.stream, self.rng = stream, random.Random(seed)
        self.sleeps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.rng.uniform(0, 3e-4))
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(self.rng.randrange(SLEEP_CYCLES))
            self.sleeps += 1

    def __enter__(self) -> CopyStreamDelays:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def plan_matches_mail(engine: LLMEngine, size: int, batch: int) -> bool:
    """Whether the last MoE layer's plan, still in the handshake's host buffer after a driven step, puts each pick
    of the real rows in the slot the planner holds for the expert the device posted (the mailbox keeps the last
    layer's routing): false if the driver read routing that was not all there yet."""
    from freetoken.moe.handshake import mail_views

    hs = engine.runner.decode.handshake
    ids = mail_views(hs.mail, size, hs.top_k, hs.hidden)[0][:batch].numpy()
    planned = hs.plan[: batch * hs.top_k].numpy().reshape(batch, hs.top_k)
    return bool((engine.experts.planner.layer_slots(engine.experts.pool.num_layers - 1)[ids] == planned).all())


def run(path: Path, prompts, delays: bool, seed: int, **engine_args) -> tuple[list, list, int]:
    """((token, log-probability) per step per prompt, [(step, what was wrong)] found after steps: stale slots or a
    last layer's plan that does not match its posted routing, sleeps queued)."""
    engine_args.setdefault("moe_backend", "fused")
    cfg = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_gb=0.5, max_num_seqs=4, **engine_args)
    engine = LLMEngine.from_dir(path, cfg)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(prompts))}
    stale: list[tuple[int, list]] = []
    check = engine_args["moe_backend"] != "fused"
    stream = engine.experts.copy_stream if check else None
    delay = CopyStreamDelays(stream, seed) if delays and stream is not None else None
    step, driven = 0, []
    runner = engine.runner.decode
    if check and isinstance(runner, DrivenGraphRunner):
        run_driven = runner._step

        def record(size: int, batch: int) -> torch.Tensor:
            logits = run_driven(size, batch)
            driven.append((size, batch))
            return logits

        runner._step = record  # type: ignore[method-assign]
    with delay if delay is not None else contextlib.nullcontext():
        while engine.has_work():
            driven.clear()
            for o in engine.step():
                out[o.request_id].extend((lp.token_id, lp.logprob) for lp in o.chunk.logprobs)
            if check:
                bad = engine.experts.stale_slots()
                if bad:
                    stale.append((step, bad[:4]))
                if driven and not plan_matches_mail(engine, *driven[-1]):
                    stale.append((step, "last layer planned from routing other than the posted one"))
            step += 1
    return [out[str(i)] for i in range(len(prompts))], stale, 0 if delay is None else delay.sleeps


def compare(got, want) -> tuple[bool, str]:
    """(all equal, one part per prompt: equal or the first differing step and the largest log-probability
    difference of the chosen tokens before it)."""
    parts, ok = [], True
    for g, w in zip(got, want, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a[0] != b[0]), None)
        upto = len(g) if first is None else first
        drift = max((abs(a[1] - b[1]) for a, b in zip(g[:upto], w[:upto], strict=True)), default=0.0)
        ok &= first is None and drift == 0.0
        parts.append(f"{'equal' if first is None else f'differs at step {first}'} (|dlogprob| {drift:.4f})")
    return ok, "; ".join(parts)


def main() -> int:
    """Every configuration once (twice for the 32-slot one); exit status 1 when any parts from fused."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 4 only, no CPU-load round")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    path = build_demo_checkpoint(tmp / "q3", seed=6, num_experts=16, num_experts_per_tok=4)
    batches = [4] if args.quick else [1, 4]
    configs = [(32, "auto"), (32, "auto"), (16, "fill"), (24, "stream")]
    all_ok = True
    for batch in batches:
        prompts = PROMPTS[:batch]
        want, _, _ = run(path, prompts, False, 0)
        for i, (slots, prefill) in enumerate(configs):
            got, stale, sleeps = run(
                path, prompts, True, i, moe_backend="offload", expert_slots=slots, prefill_strategy=prefill
            )
            ok, line = compare(got, want)
            ok &= not stale
            all_ok &= ok
            print(
                f"batch {batch}, {slots} slots, prefill {prefill}, {sleeps} copy-stream sleeps: {line}; "
                f"stale slots after steps: {stale or 'none'}",
                flush=True,
            )
    if not args.quick:
        # Every core but one busy: the driver thread is preempted mid-layer now and then.
        busy = len(os.sched_getaffinity(0)) - 1
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            prompts = PROMPTS[:4]
            want, _, _ = run(path, prompts, False, 0)
            got, stale, sleeps = run(path, prompts, True, 9, moe_backend="offload", expert_slots=32)
            ok, line = compare(got, want)
            ok &= not stale
            all_ok &= ok
            print(f"batch 4, 32 slots, CPU load, {sleeps} copy-stream sleeps: {line}; stale: {stale or 'none'}")
        finally:
            for p in hogs:
                p.kill()
                p.wait()
    print("ALL EQUAL" if all_ok else "SOME DIFFER", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
