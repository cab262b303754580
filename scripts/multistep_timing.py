"""Where a multi-step decode run's time goes in `benchmarks/offline.py`'s setting (a diagnosis,
not a benchmark): per run of `decode_steps` decode steps at 64 rows, the host time to queue the
run's steps, the GPU time of the run, the wait for its tokens, the host's processing of them,
and the gap until the next run is queued.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/multistep_timing.py \
        [--decode-steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import offline  # benchmarks/offline.py: the model and the weight mapping


def instrument(engine, runs: list[dict]) -> None:
    """Wrap the engine's run, decode, sample and accept calls to time each run's phases."""
    run_steps, decode, sample, accept = (
        engine._run_decode_steps,
        engine.runner.decode,
        engine.sampler.sample,
        engine._accept,
    )
    current: dict = {}

    def timed_run(plan, moved):
        current.clear()
        current.update(start=time.perf_counter(), steps=plan.decode.steps, rows=plan.decode.size)
        out = run_steps(plan, moved)
        current["end"] = time.perf_counter()
        runs.append(dict(current))
        return out

    def timed_decode(*args, **kwargs):
        if current and "gpu_start" not in current:
            current["gpu_start"] = torch.cuda.Event(enable_timing=True)
            current["gpu_start"].record()
        out = decode(*args, **kwargs)
        current.setdefault("first_launched", time.perf_counter())
        return out

    def timed_sample(*args, **kwargs):
        out = sample(*args, **kwargs)
        if current:
            current["queued"] = time.perf_counter()
            current["gpu_end"] = torch.cuda.Event(enable_timing=True)
            current["gpu_end"].record()
        return out

    def timed_accept(*args, **kwargs):
        if current and "waited" not in current:
            current["waited"] = time.perf_counter()
        return accept(*args, **kwargs)

    engine._run_decode_steps = timed_run
    engine.runner.decode = timed_decode
    engine.sampler.sample = timed_sample
    engine._accept = timed_accept


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-steps", type=int, default=8)
    args = p.parse_args()
    from tokenspeed.runtime import SamplingParams

    torch.manual_seed(0)
    hf, _ = offline.hf_model(None)
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab - 300, (64, 2048), device="cuda")
    engine, _ = offline.build_engine(hf, 64, 2048, 256, None, decode_steps=args.decode_steps)
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)

    def generate(batch):
        for i, row in enumerate(batch.tolist()):
            engine.add_request(i, row, params)
        while engine.has_unfinished():
            engine.step()

    t0 = time.perf_counter()
    generate((prompts + 7) % prompts.max())
    print(f"warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    runs: list[dict] = []
    instrument(engine, runs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(prompts)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    full = [r for r in runs if r["rows"] == 64 and r["steps"] == args.decode_steps]
    ms = 1e3
    gaps = [(runs[i + 1]["start"] - runs[i]["end"]) * ms for i in range(len(runs) - 1)]

    def med(values):
        return statistics.median(values) if values else float("nan")

    print(
        f"total {total:.2f} s; {len(runs)} multi-step runs, {len(full)} full "
        f"({args.decode_steps} steps x 64 rows); medians over the full ones, ms:"
    )
    phases = [
        ("queue the run's steps (host)", [(r["queued"] - r["start"]) * ms for r in full]),
        ("first step queued after", [(r["first_launched"] - r["start"]) * ms for r in full]),
        (
            "GPU, first step to last sample",
            [r["gpu_start"].elapsed_time(r["gpu_end"]) for r in full],
        ),
        ("wait for the tokens (host)", [(r["waited"] - r["queued"]) * ms for r in full]),
        ("process the tokens (host)", [(r["end"] - r["waited"]) * ms for r in full]),
        ("gap to the next run (host)", gaps),
        ("run, start to end (host)", [(r["end"] - r["start"]) * ms for r in full]),
    ]
    for label, values in phases:
        print(f"  {label:<34s}{med(values):8.2f}")
    print(
        f"decode-run time in all: {sum(r['end'] - r['start'] for r in runs):.2f} s; "
        f"gaps between runs: {sum(gaps) / ms:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
