"""Offline generation throughput: tokenspeed vs Hugging Face transformers on the same weights.

Kimi-Linear-48B-A3B shapes (27 layers, bf16, random weights: it fits one H200), 64 prompts of 2k
tokens, 256 greedy tokens each (EOS ignored). transformers runs
`KimiLinearForCausalLM.generate` (with fla-core kernels when fla is installed, and its grouped-mm
experts when available); tokenspeed runs its engine (`tokenspeed.runtime.Engine`) over the very
same parameter tensors (shared, not copied). Prints tokens/s of both and the ratio.

    python benchmarks/offline.py [--prompts 64] [--prompt-len 2048] [--new 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch


def hf_model(num_layers: int | None):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    options = {}
    if num_layers:
        options["num_hidden_layers"] = num_layers
    config = KimiLinearConfig(**options)  # the defaults are Kimi-Linear-48B-A3B's shapes
    for impl in ("grouped_mm", None):
        try:
            if impl:
                config._experts_implementation = impl
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # 48B parameters: never materialise fp32
            try:
                with torch.device("cuda"):
                    model = KimiLinearForCausalLM(config)
            finally:
                torch.set_default_dtype(default)
            return model.eval(), impl or "default"
        except Exception as exc:  # older transformers: no experts implementations
            print(f"experts implementation {impl}: {exc}", file=sys.stderr)
    raise RuntimeError("could not build KimiLinearForCausalLM")


def our_state_dict(hf) -> dict[str, torch.Tensor]:
    """transformers' in-memory Kimi Linear parameters under our names, as views (no copies)."""
    ours = {}
    inter = hf.config.moe_intermediate_size
    for name, t in list(hf.state_dict().items()):
        n = name
        n = n.replace(".self_attn.forget_gate.", ".self_attn.")
        if n.endswith(".self_attn.conv1d.weight"):
            ours[n.replace("conv1d.weight", "conv_weight")] = t.reshape(t.shape[0], -1)
            continue
        if n.endswith(".self_attn.A_log"):
            ours[n] = t.reshape(-1)
            continue
        if n.endswith(".mlp.experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            ours[base + "w1"] = t[:, :inter]
            ours[base + "w3"] = t[:, inter:]
            continue
        if n.endswith(".mlp.experts.down_proj"):
            ours[n[: -len("down_proj")] + "w2"] = t
            continue
        ours[n] = t
    return ours


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (smoke runs)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("offline needs a CUDA device", file=sys.stderr)
        return 2
    from tokenspeed.model import KimiForCausalLM, from_hf_config
    from tokenspeed.runtime import Engine, EngineConfig, SamplingParams

    torch.manual_seed(0)
    hf, experts_impl = hf_model(args.layers)
    vocab = hf.config.vocab_size
    prompts = torch.randint(0, vocab - 300, (args.prompts, args.prompt_len), device="cuda")

    # transformers
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        hf_out = hf.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new,
            min_new_tokens=args.new, do_sample=False,
        )
    torch.cuda.synchronize()
    hf_s = time.perf_counter() - t0
    hf_tokens = (hf_out.shape[1] - args.prompt_len) * args.prompts

    # tokenspeed, on the same tensors
    config = from_hf_config(hf.config.to_dict())
    with torch.device("meta"):
        ours = KimiForCausalLM(config)
    ours.load_state_dict(our_state_dict(hf), strict=True, assign=True)
    ours.eval()
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    engine = Engine(
        ours, None,
        EngineConfig(
            device="cuda", max_num_seqs=args.prompts, max_model_len=args.prompt_len + args.new + 64,
            prefill_token_budget=16384, l2="none", checkpoint_slots=args.prompts,
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts.tolist()):
        engine.add_request(i, p, params)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    torch.cuda.synchronize()
    ours_s = time.perf_counter() - t0
    ours_tokens = sum(len(v) for v in outs.values())
    agree = sum(
        a == b for i in range(args.prompts)
        for a, b in zip(outs[i], hf_out[i, args.prompt_len :].tolist(), strict=False)
    ) / max(ours_tokens, 1)
    lines = [
        f"# offline generation, Kimi-Linear-48B-A3B shapes ({config.num_layers} layers, bf16, "
        f"random weights), {args.prompts} prompts x {args.prompt_len} tokens, {args.new} new "
        f"tokens each, {torch.cuda.get_device_name()}",
        "",
        "| engine | seconds | generated tokens | tokens/s |",
        "|---|---:|---:|---:|",
        f"| transformers generate (experts: {experts_impl}) | {hf_s:.1f} | {hf_tokens} | "
        f"{hf_tokens / hf_s:.1f} |",
        f"| tokenspeed Engine | {ours_s:.1f} | {ours_tokens} | {ours_tokens / ours_s:.1f} |",
        "",
        f"ratio tokenspeed / transformers: {(ours_tokens / ours_s) / (hf_tokens / hf_s):.2f}x; "
        f"greedy tokens agreeing position by position: {agree:.1%} (bf16 on both sides)",
        "",
        f"tokenspeed metrics: {engine.metrics.summary()}",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
