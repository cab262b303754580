"""Device timings for the kernel benchmarks, in us per call.

"eager" times back-to-back calls between CUDA events, so Python launch overhead counts; "graph"
times one call captured in a CUDA graph, replayed under `triton.testing.do_bench` with the L2
flushed before every replay (each layer's weights and state are cold in a real step).
"""

from __future__ import annotations

import statistics

import torch
import triton


def time_eager(fn, iters: int = 50) -> float:
    """us per call over back-to-back calls (median of 3)."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def time_graph(fn) -> float:
    """us per replay of a graph holding one call, L2 flushed before each replay (median)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / autotune outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=80, return_mode="median") * 1e3
