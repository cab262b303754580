"""The tiny preset on the CPU: torch's default thread count against one thread, in one process.

Claim (the `tokenspeed` command's default): a model under 100M parameters generates faster
single-threaded on the CPU, and much faster when another process holds a core (`--busy` starts
one spinning process per core but one for the length of the run, as a shared machine has).
Prints tokens/s of the `generate` workload (3 prompts, 64 new tokens each) for each thread
count, best of `--repeats`, and the ratio.

    python benchmarks/cpu_threads.py [--busy] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import torch


def _spin() -> None:
    while True:
        pass


def tokens_per_second(llm, prompts, params, repeats: int) -> float:
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        best = max(best, sum(len(o.token_ids) for o in outs) / elapsed)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy", action="store_true", help="keep all cores but one busy meanwhile")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from tokenspeed import LLM, SamplingParams
    from tokenspeed.cli import DEFAULT_PROMPTS

    llm = LLM(model="tiny", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = list(DEFAULT_PROMPTS)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    default = torch.get_num_threads()
    spinners = []
    if args.busy:
        spinners = [
            multiprocessing.Process(target=_spin, daemon=True)
            for _ in range(max(1, (os.cpu_count() or 2) - 1))
        ]
        for s in spinners:
            s.start()
    try:
        rates = {}
        for threads in (default, 1):
            torch.set_num_threads(threads)
            rates[threads] = tokens_per_second(llm, prompts, params, args.repeats)
    finally:
        for s in spinners:
            s.terminate()
    print(
        f"tiny preset on the CPU ({os.cpu_count()} cores, other cores "
        f"{'busy' if args.busy else 'idle'}), {date()}:"
    )
    for threads, rate in rates.items():
        print(f"  {threads} thread(s): {rate:.1f} tokens/s")
    print(f"  one thread / {default} threads: {rates[1] / rates[default]:.2f}x")
    return 0


def date() -> str:
    return time.strftime("%Y-%m-%d")


if __name__ == "__main__":
    raise SystemExit(main())
