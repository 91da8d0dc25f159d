"""CUDA-graph timing shared by the GPU benches: a function's calls captured once and replayed, so that what is timed
is the device's work and not the host launching it (as the engine's decode graphs run)."""

from __future__ import annotations

import statistics

import torch


def capture(fn, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of `fn`, as the engine's decode graphs run a layer: no launch gaps from the
    host (what an eager loop under the profiler shows between two kernels is mostly the host launching)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on a side stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_us(fn, iters: int, calls: int = 20) -> float:
    """Median microseconds per call of `fn` replayed from a CUDA graph of `calls` calls (`capture`), over `iters`
    replays after 3 warm-up ones."""
    graph = capture(fn, calls)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
