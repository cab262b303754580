"""A/B of kernel tuning knobs inside the K3-slice decode step (`benchmarks/decode_step.py`).

A knob timed on its own kernel can look different inside a step: a cache hint that keeps a
kernel's lines in L2 may slow the kernels after it. This probe captures one set of decode
graphs per variant in one process (same model, cache and inputs), then replays the variants in
turn, round after round, so drift of the clock or of the machine falls on all of them alike.

A variant sets keyword defaults of the ops the layers call through `ops.dispatch` (which looks
the op up at every call, so a capture sees the setting), captures its graphs, and puts the
defaults back. Variants:

    base                  the library's defaults
    kda-state-no-hint     KDA decode state tiles loaded and stored with no cache hint
    kda-state-first       ... loaded and stored evict-first (the form before 2026-12-03)
    attn-res-no-hint      AttnRes completed entries loaded with no hint (default evict-first)
    attn-res-last         ... loaded evict-last

    python scripts/decode_step_ab.py [--batches 36 64 128] [--variants base kda-state-no-hint]
        [--rounds 5] [--history 3000]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from decode_step import build_engine, time_ms
from tokenspeed.model.ops.attn_res import fused as attn_res_fused
from tokenspeed.model.ops.kda import decode as kda_decode_mod
from tokenspeed.runtime.graphs import DecodeGraphs

VARIANTS = {
    "base": (),
    "kda-state-no-hint": ((kda_decode_mod.kda_decode, "state_eviction", ("", "")),),
    "kda-state-first": (
        (kda_decode_mod.kda_decode, "state_eviction", ("evict_first", "evict_first")),
    ),
    "attn-res-no-hint": ((attn_res_fused.attn_res_mix_norm, "bank_eviction", ""),),
    "attn-res-last": ((attn_res_fused.attn_res_mix_norm, "bank_eviction", "evict_last"),),
}


@contextlib.contextmanager
def keyword_defaults(settings):
    """Set (function, keyword, value) defaults for the duration of the block."""
    saved = [(fn, key, fn.__kwdefaults__[key]) for fn, key, _ in settings]
    try:
        for fn, key, value in settings:
            fn.__kwdefaults__[key] = value
        yield
    finally:
        for fn, key, value in saved:
            fn.__kwdefaults__[key] = value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[36, 64, 128])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--history", type=int, default=3000)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_step_ab needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    model, engine, handles = build_engine(device, args.batches, args.history)
    config, runner = engine.config, engine.runner
    graphs = {}
    for name in args.variants:
        t0 = time.perf_counter()
        with keyword_defaults(VARIANTS[name]):
            graphs[name] = DecodeGraphs(runner, config.graph_sizes, config.max_pages_per_request)
        print(f"{name}: captured in {time.perf_counter() - t0:.1f} s", flush=True)

    times = {(name, b): [] for name in args.variants for b in args.batches}
    inputs = {}
    for batch in args.batches:
        tokens = torch.randint(0, model.config.vocab_size, (batch,)).tolist()
        inputs[batch] = (tokens, [args.history] * batch, handles[:batch])
    # Each variant's logits against the base's (or the first variant's): a cache hint must not
    # change what the step computes. A step advances the KDA states in place, so each compared
    # step starts from the same snapshot of them; the first variant twice is the control.
    states = [t for i in range(len(model.config.kda_layers)) for t in engine.cache.kda_layer(i)]
    snapshot = [t.clone() for t in states]

    def step_from_snapshot(name, tokens, prefix, hs):
        for t, saved in zip(states, snapshot, strict=True):
            t.copy_(saved)
        return graphs[name].run(tokens, prefix, hs).float()

    first = args.variants[0]
    for batch, (tokens, prefix, hs) in inputs.items():
        want = step_from_snapshot(first, tokens, prefix, hs)
        for name in args.variants:
            got = step_from_snapshot(name, tokens, prefix, hs)
            diff = (got - want).abs().max().item()
            print(f"batch {batch}: {name} logits vs {first}: max diff {diff:.3g}", flush=True)
    snapshot.clear()  # the memory goes back before the timed rounds
    for _ in range(args.rounds):
        for batch, (tokens, prefix, hs) in inputs.items():
            for name in args.variants:
                g = graphs[name]
                times[(name, batch)].append(time_ms(lambda: g.run(tokens, prefix, hs)))  # noqa: B023

    lines = [
        f"# decode step A/B, K3 slice, history {args.history} tokens, "
        f"{torch.cuda.get_device_name()}; graph ms, median of {args.rounds} rounds "
        f"(each 20 replays), variants interleaved",
        "",
        "| variant | " + " | ".join(f"batch {b}" for b in args.batches) + " |",
        "|---|" + "---:|" * len(args.batches),
    ]
    base = {b: statistics.median(times[(first, b)]) for b in args.batches}
    for name in args.variants:
        cells = []
        for b in args.batches:
            med = statistics.median(times[(name, b)])
            spread = max(times[(name, b)]) - min(times[(name, b)])
            cells.append(f"{med:.3f} (±{spread / 2:.3f}, {base[b] / med:.3f}x)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
