"""A speculative verify step (k + 1 = 2..4 positions per request) against k + 1 single-token
decode steps, on the K3 slice of benchmarks/decode_step.py (3 KDA + 1 MLA layers at full K3
widths, 56 local experts, bf16, random weights; its engine and cache construction are imported
from there).

What a point measures, at batch B and width w = k + 1, history H tokens per request:
- verify: one forward over B rows of w tokens at positions H..H+w-1 with the logits of every
  position and the KDA per-token step buffers the rollback reads, through the engine's own
  `VerifyGraphs` (what a speculating engine's `ModelRunner.verify` replays), host-side input
  preparation included as for decode.
- decode: w one-token decode steps through the engine's own `DecodeGraphs`.
- ratio = verify / (w x decode): below 1, one verify step costs less than the plain steps it
  can replace; a mean acceptance length A pays off when A > w x ratio.

    python benchmarks/spec_verify.py [--batches 1 8 36 64 128] [--widths 2 3 4]
        [--history 3000] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/spec_verify.py --smoke   # CPU: code paths only

--smoke runs the same steps on the CPU, eagerly, on the tiny preset (batches 1 and 2, history
40): its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_step import build_engine, build_model
from tokenspeed.model import get_preset
from tokenspeed.runtime.verify_graphs import VerifyGraphs


def timer(device):
    """time_ms(fn, iters) for the device: CUDA events, or the host clock on the CPU."""
    if device.type == "cuda":
        from decode_step import time_ms

        return time_ms

    def time_cpu(fn, iters=1) -> float:
        # Smoke runs check the code paths: one untimed-warm-up-free call (the interpreter's
        # seconds per forward say nothing about a GPU anyway).
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e3

    return time_cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--history", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, eager")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if any(not 2 <= w <= 4 for w in args.widths):
        parser.error("--widths: a verify step feeds 2..4 tokens per request (k = 1..3)")
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("spec_verify needs a CUDA device (or --smoke under TRITON_INTERPRET=1)")
        return 2
    batches = args.batches or ([1, 2] if smoke else [1, 8, 36, 64, 128])
    history = args.history or (40 if smoke else 3000)
    if smoke:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        model = build_model(device, get_preset("tiny"), dtype=torch.float32)
        _, engine, handles = build_engine(device, batches, history, page=16, model=model)
        name, shape = "CPU interpreter (smoke)", "tiny preset (smoke), fp32"
    else:
        device = torch.device("cuda")
        model, engine, handles = build_engine(device, batches, history)
        name = torch.cuda.get_device_name()
        shape = "K3 slice (3 KDA + 1 MLA, 56 local experts, bf16)"
    runner = engine.runner
    time_ms = timer(device)
    if smoke:

        def decode(tokens, prefix, hs):
            return runner.forward([[t] for t in tokens], prefix, hs)

    else:
        from tokenspeed.runtime.graphs import DecodeGraphs

        graphs = DecodeGraphs(
            runner, engine.config.graph_sizes, engine.config.max_pages_per_request
        )
        decode = graphs.run
    rows = []
    with torch.no_grad():
        for batch in batches:
            tokens = torch.randint(0, model.config.vocab_size, (batch,)).tolist()
            prefix = [history] * batch
            hs = handles[:batch]
            one = time_ms(lambda: decode(tokens, prefix, hs))  # noqa: B023
            for width in args.widths:
                graphs = VerifyGraphs(
                    runner, [batch], width, engine.config.max_pages_per_request, capture=not smoke
                )
                windows = [[t] * width for t in tokens]
                out = []
                verify = time_ms(lambda: out.append(graphs.run(windows, prefix, hs)))  # noqa: B023
                assert out[-1][0].shape == (batch * width, model.config.vocab_size)
                how = "graph" if graphs.captured else "eager (smoke)"
                rows.append((batch, width, verify, one, verify / (width * one), how))
                graphs = out = None  # free the step buffers before the next width
    lines = [
        f"# speculative verify step vs k + 1 decode steps, {shape}, history {history} tokens, "
        f"{name}",
        "",
        "| batch | k + 1 | verify ms | decode ms (one step) | verify / ((k + 1) x decode) "
        "| verify run as |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for batch, width, verify, one, ratio, how in rows:
        lines.append(f"| {batch} | {width} | {verify:.2f} | {one:.2f} | {ratio:.2f} | {how} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
