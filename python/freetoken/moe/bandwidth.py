"""Measured bandwidths of the two miss paths, on the deployed expert shape (the inputs of q*).

- `measure_pcie`: host->device copies of whole experts from the pinned pool into cache slots, on a copy stream,
  timed with CUDA events; bytes/s.
- `measure_cpu`: the Rust host expert kernel at batch b over experts spread across the pool (a working set far
  larger than the last-level cache); expert weight bytes read per second.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from freetoken._core import CpuExperts, ExpertPool


def measure_pcie(
    pool: ExpertPool, arena: torch.Tensor, slots: torch.Tensor, stream: torch.cuda.Stream, num_copies: int = 256
) -> float:
    """Bytes/s of expert-sized host->device copies (pinned arena -> slots) on `stream`.

    Args:
        pool: the pool (its experts are copied, walking layers and experts so no copy repeats a source).
        arena: [pool.nbytes] uint8 view of the pinned arena.
        slots: [S, expert_stride] uint8 device tensor.
        stream: the copy stream.
        num_copies: copies timed (after one warm-up pass of 8).
    """
    n = pool.expert_nbytes
    total = pool.num_layers * pool.num_experts
    sources = [(i % pool.num_layers, (i * 7) % pool.num_experts) for i in range(num_copies + 8)]
    assert total > 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        for i, (layer, expert) in enumerate(sources):
            if i == 8:
                start.record(stream)
            off = pool.expert_offset(layer, expert)
            slots[i % slots.shape[0], :n].copy_(arena[off : off + n], non_blocking=True)
        end.record(stream)
    end.synchronize()
    return num_copies * n / (start.elapsed_time(end) / 1e3)


def measure_cpu(cpu: CpuExperts, pool: ExpertPool, batch: int, num_experts: int = 64, repeats: int = 3) -> float:
    """Expert weight bytes/s of the host kernel with `batch` tokens routed to each of `num_experts` experts.

    Experts are taken across layers so that consecutive calls read different memory (no LLC reuse); the best of
    `repeats` runs is returned.
    """
    hidden_size = pool.hidden_size
    gen = np.random.default_rng(batch)
    hidden = gen.standard_normal((batch, hidden_size), dtype=np.float32)
    out = np.zeros((batch, hidden_size), dtype=np.float32)
    per_layer = max(1, num_experts // pool.num_layers)
    best = float("inf")
    for r in range(repeats):
        layers = [(r * 3 + i) % pool.num_layers for i in range(min(num_experts, pool.num_layers))]
        t0 = time.perf_counter()
        for layer in layers:
            experts = np.arange(per_layer, dtype=np.int64) + (r * per_layer) % max(1, pool.num_experts - per_layer)
            ids = np.tile(experts[:, None], (1, batch)).T.astype(np.int64)  # every token picks every expert
            weights = np.full(ids.shape, 1.0 / per_layer, dtype=np.float32)
            cpu.forward(layer, hidden, ids, weights, experts, out)
        best = min(best, time.perf_counter() - t0)
    return len(layers) * per_layer * pool.expert_nbytes / best
