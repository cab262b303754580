"""Speculative vs plain decode throughput at forced acceptance lengths, in one process.

The model: Kimi-Linear-48B-A3B shapes (`kimi-linear-48b-a3b` preset, bf16, random weights, as
benchmarks/offline.py; `--layers` keeps fewer). The same prompts run on a fresh engine over the
same weights: once plain, then with n-gram speculation at k drafts per step (default k = 2) and
FORCED ACCEPTANCE of 0, 1, 2 drafts per step (`SpeculativeConfig.forced_acceptance`).

Forced acceptance is BENCHMARK ONLY: every verify step accepts exactly that many drafts per row
whatever the target says (rows with fewer n-gram drafts are padded with filler drafts), so its
output is not the model's. It times the engine at a fixed acceptance length, where
acceptance length = tokens emitted per verify step = accepted drafts + 1 (forced 0, 1, 2 ->
lengths 1, 2, 3; a row's window never crosses a page boundary or its max_tokens, so the
measured mean is a little below that, and printed). Every verify step feeds k + 1 positions
per row whatever the forced length.

Decode throughput = output tokens after each request's first / seconds from the moment every
request has its first token to the end (all prompts are admitted at once, so prefill is over
by then); end-to-end tokens/s is printed too. Ratio = speculative / plain decode throughput.

    python benchmarks/spec_decode.py [--prompts 64] [--prompt-len 2048] [--new 256]
        [--num-steps 2] [--forced 0 1 2] [--layers N] [--out FILE]
    TRITON_INTERPRET=1 python benchmarks/spec_decode.py --smoke   # CPU: code paths only

--smoke: the tiny preset on the CPU (fp32), 2 prompts of 24 tokens, 8 new tokens each, no
warm-up: its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# The setup is offline.py's: model, prompts, engine configuration and timing loop.
from offline import (
    bench_engine_config,
    device_sync,
    kimi_linear_config,
    make_prompts,
    preset_model,
    run_requests,
    smoke_model,
)
from tokenspeed.runtime import Engine
from tokenspeed.runtime.spec import SpeculativeConfig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--num-steps", type=int, default=2, help="k, drafts per verify step")
    parser.add_argument("--forced", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (GPU runs)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, no warm-up")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if any(not 0 <= f <= args.num_steps for f in args.forced):
        parser.error(f"--forced: 0..--num-steps ({args.num_steps}) accepted drafts per step")
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("spec_decode needs a CUDA device (or --smoke under TRITON_INTERPRET=1)")
        return 2
    n = args.prompts or (2 if smoke else 64)
    prompt_len = args.prompt_len or (24 if smoke else 2048)
    new = args.new or (8 if smoke else 256)
    if smoke:
        device = torch.device("cpu")
        model = smoke_model()
        name = "CPU interpreter (smoke)"
    else:
        device = torch.device("cuda")
        model = preset_model(device, kimi_linear_config(args.layers))
        name = torch.cuda.get_device_name()
    sync = device_sync(device)
    prompts, warm = make_prompts(n, prompt_len, model.config.vocab_size)
    settings = [("plain", None)] + [
        (
            f"ngram k={args.num_steps}, forced {f} (length {f + 1})",
            SpeculativeConfig(method="ngram", num_steps=args.num_steps, forced_acceptance=f),
        )
        for f in args.forced
    ]
    rows = []
    for label, spec in settings:
        engine = Engine(
            model,
            None,
            bench_engine_config(
                device,
                n,
                prompt_len,
                new,
                prefill_token_budget=max(prompt_len, 256 if smoke else 16384),
                speculative=spec,
            ),
        )
        if not smoke:  # compile and tune every shape first (other prompts: no prefix hits)
            run_requests(engine, warm, new, sync)
            engine.reset_metrics()
        got = run_requests(engine, prompts, new, sync)
        m = engine.metrics
        got["length"] = m.mean_acceptance_length if spec is not None else 1.0
        rows.append((label, got))
        engine.close()
        del engine
        gc.collect()
        if not smoke:
            torch.cuda.empty_cache()
    plain = rows[0][1]["decode_tok_s"]
    lines = [
        f"# speculative vs plain decode, {model.config.name} ({model.config.num_layers} layers, "
        f"{'fp32' if smoke else 'bf16'}, random weights), {n} prompts x {prompt_len} tokens, "
        f"{new} new tokens each, {name}",
        "",
        "FORCED ACCEPTANCE IS BENCHMARK ONLY: the speculative rows' outputs are not the model's;",
        "acceptance length = tokens emitted per verify step (forced accepted drafts + 1).",
        "",
        "| run | mean acceptance length | decode tok/s | vs plain | end-to-end tok/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, got in rows:
        ratio = got["decode_tok_s"] / plain if plain else float("nan")
        lines.append(
            f"| {label} | {got['length']:.2f} | {got['decode_tok_s']:.1f} | {ratio:.2f}x "
            f"| {got['tok_s']:.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
