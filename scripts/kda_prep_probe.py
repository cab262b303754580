"""Probe: where should the split KDA decode do the v conv?

`kda_decode`'s split variant can do the conv of the v channels in its recurrence kernel (each
program convolves its own BV channels: a [BV, W-1] window read and rewritten after a barrier)
or in its prep kernel (`v_in_prep`: the prep writes the conv'd v into the record; the recurrence
then touches no conv state). Times both (CUDA graph, L2 flushed before each replay, as
benchmarks/kda_decode.py) at 1, 2 and 4 tokens per row, with the prep at 1-4 warps, against
fla's step at one token; also the state tiles' and the records' cache eviction hints
(`state_eviction`, `record_eviction`).

    PYTHONPATH=src:benchmarks python scripts/kda_prep_probe.py [--requests 36,64,128]

Needs fla-core (the baseline). Findings: docs/perf/kda.md, "Prep options probe".
"""

from __future__ import annotations

import argparse

import torch

from fla_tuning import fastest
from kda_decode import (
    H,
    K,
    V,
    copy_bandwidth,
    fla_conv_tuner,
    fla_path,
    make_inputs,
    time_graph,
)
from tokenspeed.model.ops.kda.decode import decode_scratch, kda_decode

FIRST = ("evict_first", "evict_first")  # state_eviction before 2026-12-03 (fifth session)
OPTIONS = [
    ("default", {}),
    (
        "before: state_eviction evict_first both, prep_warps=4",
        {"state_eviction": FIRST, "prep_warps": 4},
    ),
    ("v conv in the recurrence", {"v_in_prep": False}),
    ("v conv in the prep", {"v_in_prep": True}),
    ("prep_warps=1", {"prep_warps": 1}),
    ("record_eviction evict_last", {"record_eviction": "evict_last"}),
    (
        "record_eviction evict_last, v conv in the prep",
        {"record_eviction": "evict_last", "v_in_prep": True},
    ),
]


def step(inp, **kw):
    batch, steps = inp["qkv"].shape[:2]
    scratch = decode_scratch(batch, steps, H, K, "cuda", V, v_in_prep=kw.get("v_in_prep"))
    counters = torch.zeros(batch, H, dtype=torch.int32, device="cuda")
    return lambda: kda_decode(
        **inp, gate="lower_bound", lower_bound=-5.0, scratch=scratch, counters=counters, **kw
    )


def check(inp, kw) -> float:
    """Max |difference| of out, state and conv state between an option and the default."""
    results = []
    for options in ({}, kw):
        pool = inp["recurrent_state"].clone()
        conv = inp["conv_state"].clone()
        args = {**inp, "recurrent_state": pool, "conv_state": conv}
        out = step(args, **options)()
        torch.cuda.synchronize()
        results.append((out.float(), pool, conv.float()))
    (o0, s0, c0), (o1, s1, c1) = results
    return max(
        (o0 - o1).abs().max().item(), (s0 - s1).abs().max().item(), (c0 - c1).abs().max().item()
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", default="36,64,128")
    args = p.parse_args()
    copy = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {copy / 1e12:.2f} TB/s")
    for batch in (int(x) for x in args.requests.split(",")):
        inp = make_inputs(batch, 1, seed=batch)
        state_bytes = 2 * batch * H * K * V * 4
        t_fla, best = fastest(
            fla_conv_tuner(), lambda inp=inp: time_graph(fla_path(inp, "lower_bound"))
        )
        print(f"\n{batch} requests, 1 token; fla step {t_fla:.1f} us (conv config {best})")
        print("| option | max diff vs default | graph us | % of copy | x fla |")
        print("|---|---|---|---|---|")
        for name, kw in OPTIONS:
            diff = check(inp, kw)
            t = time_graph(step(inp, **kw))
            frac = state_bytes / (t * 1e-6) / copy
            print(f"| {name} | {diff:.1e} | {t:.1f} | {frac:.0%} | {t_fla / t:.3f} |", flush=True)
    for steps in (2, 4):
        inp = make_inputs(36, steps, seed=steps)
        print(f"\n36 requests, verify-{steps} (grid wait)")
        print("| option | max diff vs default | graph us |")
        print("|---|---|---|")
        for name, kw in OPTIONS:
            diff = check(inp, kw)
            print(f"| {name} | {diff:.1e} | {time_graph(step(inp, **kw)):.1f} |", flush=True)


if __name__ == "__main__":
    main()
