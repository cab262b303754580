"""Host cost of the routed experts at decode sizes: bf16 vs FP8 `fused_experts`, eager and in a
CUDA graph (GPU; < 1 min on an H200).

Shapes, weights and routing are benchmarks/moe.py's (K3 widths, 56 local experts of 896,
top-16, SiTU). Per format and token count it prints, per call:
- eager host: the Python + launch time of a loop of calls with no synchronisation (the queue
  never fills: N calls x 5 launches stay far below the launch queue's depth);
- eager wall: the same loop until the GPU is done (max of host and GPU time, about);
- graph host / graph wall: the same for replays of one CUDA graph of a call (the kernels'
  time, with next to no host work);
and the FP8 / bf16 ratios. At 16-64 tokens the eager wall is the host time: FP8's eager host
should be about bf16's plus one launch (the activation quantisation). --breakdown adds the host
time of each kernel's launch (Triton's `run`, measured around the call) and of the rest.

    python3 benchmarks/moe_host.py                  # 16 and 64 tokens
    python3 benchmarks/moe_host.py --tokens 16 --breakdown
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe import (  # benchmarks/moe.py: shapes, weights, routing, the call
    BIAS_STD,
    DEVICE,
    DTYPE,
    EXPERTS,
    HIDDEN,
    LATENT,
    LOCAL,
    TOP_K,
    fp8_experts,
    make_weights,
    situ_experts,
)
from tokenspeed.model.ops.moe.experts import ExpertWeights
from tokenspeed.model.ops.moe.gate import route_fused, router_weight_for_kernel


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(host us, wall us) per call of a loop of `calls` calls started on an idle GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / calls * 1e6, wall / calls * 1e6


def best(fn, calls: int, repeats: int) -> tuple[float, float]:
    """Per-call (host, wall) of the repeat with the least host time (the least disturbed)."""
    return min((per_call_us(fn, calls) for _ in range(repeats)), key=lambda r: r[0])


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def launch_breakdown(fn, calls: int) -> dict[str, float]:
    """Host us per call spent inside each Triton/Gluon kernel's launch, and in the rest."""
    from triton.runtime.jit import JITFunction

    spent: dict[str, float] = collections.defaultdict(float)
    original = JITFunction.run

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[self.fn.__name__] += time.perf_counter() - t0

    JITFunction.run = timed
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        total = time.perf_counter() - start
        torch.cuda.synchronize()
    finally:
        JITFunction.run = original
    out = {name: t / calls * 1e6 for name, t in spent.items()}
    out["(outside launches)"] = total / calls * 1e6 - sum(out.values())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="16,64")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops (the best is kept)")
    parser.add_argument("--breakdown", action="store_true", help="host us per kernel launch")
    args = parser.parse_args()

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    gate_w = (torch.randn(EXPERTS, HIDDEN, device=DEVICE, generator=gen) * HIDDEN**-0.5).to(DTYPE)
    gate_w = gate_w.float()
    gate_w_kernel = router_weight_for_kernel(gate_w)
    bias = torch.randn(EXPERTS, device=DEVICE, generator=gen) * BIAS_STD
    w1, w2, w3 = make_weights(gen)
    formats = {
        "bf16": ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3),
        "fp8": fp8_experts(w1, w2, w3),
    }
    print(
        f"# MoE experts host cost ({torch.cuda.get_device_name()}, torch {torch.__version__}); "
        f"us per call, {args.calls} calls a loop, best of {args.repeats}"
    )
    print("| format | tokens | eager host | eager wall | graph host | graph wall |")
    print("|---|---:|---:|---:|---:|---:|")
    results = {}
    breakdowns = {}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, HIDDEN, device=DEVICE, generator=gen).to(DTYPE)
        h = torch.randn(tokens, LATENT, device=DEVICE, generator=gen).to(DTYPE)
        routing = route_fused(x, gate_w_kernel, bias, TOP_K, num_local=LOCAL)
        for fmt, experts in formats.items():

            def call(h=h, routing=routing, experts=experts, tokens=tokens):
                return situ_experts(h, routing, experts, tokens)

            for _ in range(3):  # compile, warm the allocator
                call()
            eager = best(call, args.calls, args.repeats)
            graph = graph_of(call)
            replay = best(graph.replay, args.calls, args.repeats)
            del graph
            results[fmt, tokens] = eager + replay
            print(
                f"| {fmt} | {tokens} | {eager[0]:.1f} | {eager[1]:.1f} | {replay[0]:.1f} | "
                f"{replay[1]:.1f} |",
                flush=True,
            )
            if args.breakdown:
                breakdowns[fmt, tokens] = launch_breakdown(call, args.calls)
    print()
    for tokens in sorted({t for _, t in results}):
        fp8, bf16 = results["fp8", tokens], results["bf16", tokens]
        print(
            f"fp8/bf16 at {tokens} tokens: eager host {fp8[0] / bf16[0]:.2f}x, eager wall "
            f"{fp8[1] / bf16[1]:.2f}x, graph wall {fp8[3] / bf16[3]:.2f}x"
        )
    for (fmt, tokens), parts in breakdowns.items():
        listed = ", ".join(f"{name} {us:.1f}" for name, us in sorted(parts.items()))
        print(f"launch host us, {fmt} at {tokens} tokens: {listed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
