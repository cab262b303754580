"""Where our engine's time goes in `benchmarks/offline.py`'s setting (a diagnosis, not a
benchmark): CUDA kernel time by kernel for one prefill step and for decode steps, after a
warm-up on the same shapes.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/offline_profile.py \
        [--decode-steps 4] [--top 25] [--host-profile]

Prints, for the first prefill step (16384 tokens) and for `--decode-steps` decode steps at 64
rows: the step's wall time, the summed CUDA kernel time and the `--top` kernels by CUDA time
(with their share of the kernel time); then the 64-row decode graph replayed on its own, so that
step wall - replay is the engine's host work between replays.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import offline  # benchmarks/offline.py: the model and the weight mapping


def kernel_table(prof, top: int) -> str:
    """The `top` CUDA kernels by total device time, with counts and shares."""
    rows = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name[:90]
        t, n = rows.get(name, (0.0, 0))
        rows[name] = (t + evt.device_time, n + 1)
    total = sum(t for t, _ in rows.values())
    lines = [f"  kernel time {total / 1e3:.1f} ms over {sum(n for _, n in rows.values())} kernels"]
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / 1e3:8.2f} ms {100 * t / max(total, 1e-9):5.1f}%  x{n:<5d} {name}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="also cProfile the host side of --decode-steps decode steps",
    )
    args = p.parse_args()
    from tokenspeed.runtime import SamplingParams

    torch.manual_seed(0)
    hf, _ = offline.hf_model(None)
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab - 300, (64, 2048), device="cuda")
    engine, _ = offline.build_engine(hf, 64, 2048, 256, None)

    def add(batch, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(batch.tolist()):
            engine.add_request(i, prompt, params)

    def timed_step() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    # Warm-up on the timed shapes (other prompts): every prefill chunk and a few decode steps.
    add((prompts + 7) % (vocab - 300), 4)
    while engine.has_unfinished():
        engine.step()

    add(prompts, 256)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = timed_step()
    print(f"prefill step 1: {wall * 1e3:.1f} ms wall")
    print(kernel_table(prof, args.top), flush=True)
    steps = 1
    while engine.has_unfinished() and steps < 8:  # the rest of the prefill phase
        timed_step()
        steps += 1
    for _ in range(2):  # past the prefill-to-decode switch
        timed_step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        walls = [timed_step() for _ in range(args.decode_steps)]
    print(f"decode: {args.decode_steps} steps, wall {[round(w * 1e3, 1) for w in walls]} ms")
    print(kernel_table(prof, args.top), flush=True)
    graphs = engine.runner.graphs
    if graphs is not None and graphs.captured:
        # The decode graph replayed back to back (same inputs): the step without the engine's
        # host work, so step wall - replay = what the host adds between replays.
        graph = graphs.graphs[next(s for s in graphs.sizes if s >= 64)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay = start.elapsed_time(end) / 10
        step = sorted(walls)[len(walls) // 2] * 1e3
        print(
            f"decode graph replay alone: {replay:.1f} ms; step {step:.1f} ms; host adds "
            f"{step - replay:.1f} ms a step"
        )
    if args.host_profile and engine.has_unfinished():
        # Host time by function over a few decode steps (cProfile slows Python, so read the
        # shares, not the absolute times; waiting for the GPU shows in the sampler's read).
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.decode_steps):
            engine.step()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    engine.close()
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
