"""FP8 MLA cache + bf16 KDA checkpoints against the default cache, through `LLM`.

A transformers-written Kimi Linear checkpoint (a small random config saved by transformers'
`save_pretrained`, as tests/model/hf_kimi_linear.py builds them; `--checkpoint DIR` for a real
one) runs a fixed, seeded prompt set twice: with `kv_cache_dtype="auto"` and fp32 KDA
checkpoints (the reference), and with `kv_cache_dtype="fp8_e4m3", kda_checkpoint_dtype=
"bfloat16"`. The second half of the prompts extends the first half's, so they are prefix hits:
they restore (bf16) KDA checkpoints and attend to stored (FP8) MLA pages.

Next-token logits: each prompt runs alone through `LLM.generate` (greedy, N tokens), and the
logits its prefill returns (`ModelRunner.forward`'s rows, the exact logits the sampler gets; a
wrapper records them) are compared: max and mean |logit diff| per prompt. Greedy agreement: the
fraction of prompts whose first N greedy tokens agree, and the mean agreeing prefix length.

    python benchmarks/fp8_cache_agreement.py [--prompts 16] [--tokens 16] [--device cpu]
        [--dtype float32] [--checkpoint DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

REFERENCE = dict(kv_cache_dtype="auto", kda_checkpoint_dtype="float32")
NARROW = dict(kv_cache_dtype="fp8_e4m3", kda_checkpoint_dtype="bfloat16")


def write_checkpoint(path: Path, tiny: bool) -> None:
    """A random Kimi Linear checkpoint written by transformers (tests/model/hf_kimi_linear.py);
    `tiny`: the tests' config, else wider (hidden 256, MLA rows 128 + 32 wide, 8 layers)."""
    sys.path.insert(0, str(ROOT))
    from tests.model.hf_kimi_linear import save_tiny_kimi_linear

    if tiny:
        save_tiny_kimi_linear(path, seed=11)
        return
    save_tiny_kimi_linear(
        path,
        seed=11,
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=96,
        num_hidden_layers=8,
        kv_lora_rank=128,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        linear_head_dim=32,
        linear_num_heads=8,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
    )


def prompt_set(count: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of mixed lengths (5 .. 300 tokens); the second half extends the first
    half's prompts by a few tokens (prefix hits)."""
    gen = torch.Generator().manual_seed(seed)
    first = (count + 1) // 2
    base = []
    for i in range(first):
        n = int(torch.randint(5, 300, (1,), generator=gen)) if i else 300
        base.append(torch.randint(3, vocab, (n,), generator=gen).tolist())
    extended = []
    for i in range(count - first):
        tail = int(torch.randint(1, 40, (1,), generator=gen))
        extended.append(base[i] + torch.randint(3, vocab, (tail,), generator=gen).tolist())
    return base + extended


def run(path, prompts, tokens, device, dtype, options):
    """Per prompt: (next-token logits [vocab] fp32 on the CPU, greedy tokens, cached tokens)."""
    from tokenspeed import LLM, SamplingParams

    llm = LLM(
        str(path),
        dtype=dtype,
        device=device,
        page_size=16,
        checkpoint_interval_pages=2,
        max_num_seqs=4,
        enable_cuda_graph=False,
        **options,
    )
    runner = llm.engine.runner
    forward = runner.forward
    seen: list[torch.Tensor] = []

    def recording(*args, **kwargs):
        logits = forward(*args, **kwargs)
        if logits.shape[0]:
            seen.append(logits.detach().float().cpu())
        return logits

    runner.forward = recording
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    results = []
    try:
        for prompt in prompts:
            seen.clear()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            # One request alone: the first forward that returns a row is its prefill's last.
            assert seen and seen[0].shape[0] == 1, [s.shape for s in seen]
            completion = out.outputs[0]
            results.append((seen[0][0], list(completion.token_ids), out.metrics.cached_tokens))
    finally:
        llm.close()
    return results


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint",
        help="a Kimi Linear checkpoint directory (default: a "
        "random one written by transformers into a temporary directory)",
    )
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random config")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens compared (N)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)

    scratch = None
    if args.checkpoint:
        path = Path(args.checkpoint)
    else:
        scratch = Path(tempfile.mkdtemp(prefix="fp8_agreement_"))
        path = scratch / "kimi_linear"
        write_checkpoint(path, args.tiny)
    try:
        import json

        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        prompts = prompt_set(args.prompts, vocab, args.seed)
        t0 = time.perf_counter()
        ref = run(path, prompts, args.tokens, args.device, args.dtype, REFERENCE)
        got = run(path, prompts, args.tokens, args.device, args.dtype, NARROW)
        elapsed = time.perf_counter() - t0
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    source = args.checkpoint or (
        "transformers-written random, tiny" if args.tiny else "transformers-written random, small"
    )
    print(
        f"# FP8 MLA cache + bf16 KDA checkpoints vs default cache: {source}; "
        f"{len(prompts)} prompts, N={args.tokens}, {args.device} {args.dtype}"
    )
    print()
    print(
        "| prompt | tokens | cached (fp8 run) | max abs logit diff | mean abs logit diff "
        "| agreeing prefix |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    maxes, means, prefixes = [], [], []
    for i, (p, (lw, tw, _), (lg, tg, cached)) in enumerate(zip(prompts, ref, got, strict=True)):
        diff = (lg - lw).abs()
        maxes.append(diff.max().item())
        means.append(diff.mean().item())
        prefixes.append(agreeing_prefix(tw, tg))
        print(
            f"| {i} | {len(p)} | {cached} | {maxes[-1]:.4g} | {means[-1]:.4g} "
            f"| {prefixes[-1]}/{args.tokens} |"
        )
    logit_std = torch.stack([r[0] for r in ref]).std().item()
    agree = sum(n == args.tokens for n in prefixes) / len(prefixes)
    print()
    print(f"logit std (reference): {logit_std:.4g}")
    print(f"|logit diff|: max {max(maxes):.4g}, mean {sum(means) / len(means):.4g}")
    print(
        f"greedy agreement: {agree:.4g} of prompts agree on all {args.tokens} tokens; "
        f"mean agreeing prefix {sum(prefixes) / len(prefixes):.4g}"
    )
    print(f"wall: {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
