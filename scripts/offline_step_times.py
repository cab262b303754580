"""Per-step wall times of our engine in `benchmarks/offline.py`'s setting (a diagnosis, not a
benchmark): finds steps that pay one-time costs (Triton compilation, autotuning) in a timed run.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/offline_step_times.py \
        [--checkpoint-slots 64] [--warm-prompts 8]

Warms up on `--warm-prompts` other prompts (the offline benchmark's old warm-up: 8, one prefill
step), then prints the total, the 16 longest steps and the decode-phase median / mean.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import offline  # benchmarks/offline.py: the model and the weight mapping


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-slots", type=int, default=64)
    p.add_argument("--warm-prompts", type=int, default=8)
    args = p.parse_args()
    from tokenspeed.runtime import SamplingParams

    torch.manual_seed(0)
    hf, _ = offline.hf_model(None)
    prompts = torch.randint(0, hf.config.vocab_size - 300, (64, 2048), device="cuda")
    engine, _ = offline.build_engine(hf, 64, 2048, 256, args.checkpoint_slots)

    def run(batch, max_tokens: int) -> list[float]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(batch.tolist()):
            engine.add_request(i, prompt, params)
        times = []
        while engine.has_unfinished():
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return times

    run((prompts[: args.warm_prompts] + 7) % prompts.max(), 4)
    times = run(prompts, 256)
    longest = sorted(sorted(range(len(times)), key=lambda i: -times[i])[:16])
    decode = sorted(times[8:])
    print(f"{len(times)} steps, {sum(times):.2f} s")
    print("longest steps (index, s):", [(i, round(times[i], 3)) for i in longest])
    print(
        f"decode phase: median {decode[len(decode) // 2] * 1e3:.1f} ms, "
        f"mean {sum(decode) / len(decode) * 1e3:.1f} ms"
    )
    engine.close()
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
