"""The `tokenspeed` command.

    tokenspeed generate                 # the tiny preset with random weights, a few prompts
    tokenspeed generate --model PATH    # a Hugging Face layout Kimi Linear / K3 checkpoint
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "def fibonacci(n):",
    "Agents call tools, wait, and come back with",
)
# Byte-level stand-in tokenizer for presets (which ship no tokenizer): ids 0-2 are special.
BYTE_OFFSET = 3


def encode_bytes(text: str, vocab_size: int) -> list[int]:
    if vocab_size < 256 + BYTE_OFFSET:
        raise SystemExit(f"a vocabulary of {vocab_size} cannot hold byte tokens; use --prompt-ids")
    return [b + BYTE_OFFSET for b in text.encode()]


def decode_bytes(ids: Sequence[int]) -> str:
    data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET)
    return data.decode(errors="replace")


def _load(model: str, dtype: str, device: str, seed: int):
    from pathlib import Path

    from tokenspeed.model import PRESETS, KimiForCausalLM, get_preset
    from tokenspeed.model.init import init_random_weights
    from tokenspeed.model.loader import load_checkpoint

    if model in PRESETS:
        net = init_random_weights(KimiForCausalLM(get_preset(model)), seed=seed)
        return net.to(device=device, dtype=getattr(torch, dtype) if dtype != "auto" else None)
    if not Path(model).is_dir():
        raise SystemExit(f"--model {model!r} is neither a preset {sorted(PRESETS)} nor a directory")
    return load_checkpoint(model, dtype=dtype, device=device)


def generate(args: argparse.Namespace) -> int:
    from tokenspeed.model import PRESETS
    from tokenspeed.model.generate import greedy_generate

    torch.manual_seed(args.seed)
    model = _load(args.model, args.dtype, args.device, args.seed).eval()
    vocab = model.config.vocab_size
    if args.prompt_ids:
        prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids]
    else:
        prompts = [encode_bytes(p, vocab) for p in (args.prompt or DEFAULT_PROMPTS)]
    greedy_generate(model, prompts[:1], max_new_tokens=2)  # warm-up
    start = time.perf_counter()
    outputs = greedy_generate(model, prompts, max_new_tokens=args.max_new_tokens, stop_token_ids=())
    elapsed = time.perf_counter() - start
    random_weights = args.model in PRESETS
    for prompt, out in zip(prompts, outputs, strict=True):
        head = out[:12] + (["..."] if len(out) > 12 else [])
        text = "" if args.prompt_ids or random_weights else f" {decode_bytes(out)!r}"
        print(f"{len(prompt):4d} prompt tokens -> {len(out)} tokens {head}{text}")
    if random_weights:
        print(f"({args.model} is a preset with random weights: its tokens are noise; "
              "this run measures speed)")
    generated = sum(len(o) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model {model.config.name} ({params / 1e6:.2f}M params, {args.device}): "
        f"{len(prompts)} prompts, {prompt_tokens} prompt tokens, {generated} generated tokens "
        f"in {elapsed:.2f} s = {generated / elapsed:.1f} tokens/s"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenspeed")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation from a few prompts")
    gen.add_argument("--model", default="tiny", help="a preset name or a checkpoint directory")
    gen.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    gen.add_argument("--prompt-ids", action="append", help="comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=generate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
