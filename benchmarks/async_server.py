"""AsyncEngine in a server-like loop: stepping inline (the default) vs on a worker thread.

`AsyncEngine(engine, step_thread=True)` runs each engine step on a worker thread so that the
event loop keeps serving I/O while the model computes; the two threads share the GIL. This
script measures whether that pays on a given machine: the same engine, the same request shapes,
the two modes side by side in one process, alternating, with fresh prompts per run (random
token ids, so that no run reuses another's cached prefix).

Each run: `--clients` streaming consumers arrive `--stagger-ms` apart, each with a prompt of
`--prompt-len` random tokens and `--new` generated tokens (EOS ignored). For every output a
consumer receives it does `--work-us` of pure-Python work holding the GIL (standing in for
encoding and writing a server response), then yields to the loop. A ticker task asks the loop
for a 1 ms sleep over and over and records how late it wakes (what every other connection of
the server would wait). Reported per mode: output tokens/s (first arrival to last token), mean
TTFT, P50 / P90 inter-token latency seen by the consumers, and the ticker's P99 / max lag; then
the ratio thread / inline.

    python benchmarks/async_server.py [--preset kimi-linear-48b-a3b] [--layers 27]
        [--clients 64] [--prompt-len 1024] [--new 64] [--work-us 0,200] [--repeats 2]
    python benchmarks/async_server.py --device cpu --preset tiny --clients 4 --new 4 \
        --prompt-len 16 --work-us 0 --repeats 1     # a smoke run of the code paths
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import fill_random_on_device
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.llm import _keep_fp32


def build_model(preset: str, layers: int | None, device: torch.device) -> KimiForCausalLM:
    """Random bf16 weights (std 0.02) built on the device directly, never in fp32 on the host."""
    config = get_preset(preset)
    if layers is not None:
        config = config.evolve(
            layer_kinds=config.layer_kinds[:layers], mlp_kinds=config.mlp_kinds[:layers]
        )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the meta parameters' dtype, kept by to_empty
    try:
        with torch.device("meta"):
            model = KimiForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model = fill_random_on_device(model.to_empty(device=device))
    _keep_fp32(model)
    return model.eval()


def spin(seconds: float) -> None:
    """Hold the GIL for `seconds` (pure Python, like encoding a response)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def serve(engine: Engine, thread: bool, prompts, params, stagger_s: float, work_s: float):
    """Run the consumers and the ticker; returns the measurements of one run. A fresh
    AsyncEngine per run: each run has its own event loop."""
    async_engine = AsyncEngine(engine, step_thread=thread)
    loop = asyncio.get_running_loop()
    ttfts, itls, tokens = [], [], 0
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            asked = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - asked - 0.001)

    async def client(i: int, prompt: list[int]) -> None:
        nonlocal tokens
        await asyncio.sleep(i * stagger_s)
        sent = loop.time()
        last, seen = None, 0
        async for out in async_engine.generate(f"c{i}", prompt, params):
            now = loop.time()
            new = len(out.outputs[0].token_ids) - seen
            seen += new
            if new:
                if last is None:
                    ttfts.append(now - sent)
                else:
                    # A batch of k tokens that arrived together counts as k gaps.
                    itls.extend([(now - last) / new] * new)
                last = now
            spin(work_s)
            await asyncio.sleep(0)
        tokens += seen

    tick = loop.create_task(ticker())
    start = loop.time()
    await asyncio.gather(*(client(i, p) for i, p in enumerate(prompts)))
    wall = loop.time() - start
    done.set()
    await tick
    await async_engine.wait_idle()
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "ttft_ms": 1e3 * statistics.fmean(ttfts),
        "itl_p50_ms": 1e3 * percentile(itls, 0.5),
        "itl_p90_ms": 1e3 * percentile(itls, 0.9),
        "lag_p99_ms": 1e3 * percentile(lags, 0.99),
        "lag_max_ms": 1e3 * max(lags, default=0.0),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="kimi-linear-48b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--stagger-ms", type=float, default=2.0)
    parser.add_argument("--work-us", default="0,200", help="comma-separated; one set of runs each")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "no CUDA device: pass --device cpu (with --preset tiny) for a smoke run",
            file=sys.stderr,
        )
        return 2
    model = build_model(args.preset, args.layers, device)
    config = EngineConfig(
        device=str(device),
        max_num_seqs=args.clients,
        max_model_len=args.prompt_len + args.new + 64,
        enable_cuda_graph=device.type == "cuda",
    )
    engine = Engine(model, None, config)
    vocab = model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)

    def prompts():
        return torch.randint(1, vocab, (args.clients, args.prompt_len), generator=gen).tolist()

    modes = {"inline": False, "thread": True}
    # Warm-up: kernel compilation and autotuning are not timed.
    for thread in modes.values():
        asyncio.run(serve(engine, thread, prompts(), params, 0.0, 0.0))

    works = [float(w) for w in args.work_us.split(",")]
    results: dict[tuple[float, str], list[dict]] = {}
    for work in works:
        for rep in range(args.repeats):
            order = list(modes) if rep % 2 == 0 else list(reversed(modes))
            for name in order:
                run = asyncio.run(
                    serve(engine, modes[name], prompts(), params, args.stagger_ms / 1e3, work / 1e6)
                )
                results.setdefault((work, name), []).append(run)
                print(
                    f"work {work:g} us, {name}, repeat {rep}: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in run.items()),
                    flush=True,
                )

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"AsyncEngine, {device_name}, {time.strftime('%Y-%m-%d')}: preset {args.preset}"
        f"{f' (first {args.layers} layers)' if args.layers else ''}, {args.clients} clients "
        f"{args.stagger_ms:g} ms apart, prompts {args.prompt_len}, {args.new} new tokens, "
        f"median of {args.repeats} runs per cell",
        "",
        "| work per output (us) | mode | tok/s | TTFT mean ms | ITL P50 ms | ITL P90 ms "
        "| loop lag P99 ms | loop lag max ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = ["tok_s", "ttft_ms", "itl_p50_ms", "itl_p90_ms", "lag_p99_ms", "lag_max_ms"]
    medians = {
        cell: {k: statistics.median(r[k] for r in runs) for k in keys}
        for cell, runs in results.items()
    }
    for (work, name), m in medians.items():
        lines.append(f"| {work:g} | {name} | " + " | ".join(f"{m[k]:.1f}" for k in keys) + " |")
    lines.append("")
    for work in works:
        a, b = medians[(work, "inline")], medians[(work, "thread")]
        lines.append(
            f"work {work:g} us: thread / inline tok/s {b['tok_s'] / a['tok_s']:.2f}x, "
            f"ITL P90 {b['itl_p90_ms'] / a['itl_p90_ms']:.2f}x, "
            f"TTFT {b['ttft_ms'] / a['ttft_ms']:.2f}x, "
            f"loop lag max {b['lag_max_ms']:.1f} vs {a['lag_max_ms']:.1f} ms"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
