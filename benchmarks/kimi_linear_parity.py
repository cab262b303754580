"""Our GPU model against transformers' at Kimi-Linear-48B-A3B widths, fp32 and bf16.

A random `KimiLinearForCausalLM` with the 48B-A3B config but fewer layers (default 5: a dense
layer, three KDA layers, an MLA layer; all real widths, 256 experts top-8), our model over the
very same tensors (views), next-token logits of 2 prompts x 512 tokens compared at the last 8
positions. fp32 checks the two compute the same function at real widths (our Triton paths and
transformers' fla / grouped-mm paths alike); bf16 checks our kernels drift from fp32 no more than
transformers' own bf16 path does (random-weight MoE logits move a lot in bf16: near-tied router
scores flip experts).

    python benchmarks/kimi_linear_parity.py [--layers 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline import our_state_dict


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kimi_linear_parity needs a CUDA device", file=sys.stderr)
        return 2
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from tokenspeed.model import ForwardBatch, KimiForCausalLM, from_hf_config

    t0 = time.perf_counter()
    torch.manual_seed(0)
    config = KimiLinearConfig(num_hidden_layers=args.layers)
    config._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        hf = KimiLinearForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size - 300, (2, 512), device="cuda")

    def ours_of(model):
        with torch.device("meta"):
            ours = KimiForCausalLM(from_hf_config(model.config.to_dict()))
        ours.load_state_dict(our_state_dict(model), strict=True, assign=True)
        return ours.eval()

    def run_ours(model):
        batch = ForwardBatch.build([ids.shape[1]] * ids.shape[0], device="cuda")
        with torch.no_grad():
            logits = model(ids.reshape(-1), batch, model.empty_state(ids.shape[0])).logits
        return logits.float().reshape(*ids.shape, -1)[:, -8:]

    def run_hf(model):
        with torch.no_grad():
            return model(ids).logits.float()[:, -8:]

    lines = [
        f"# ours vs transformers, Kimi-Linear-48B-A3B widths, {args.layers} layers, random "
        f"weights, 2 x 512-token prompts, last 8 positions, {torch.cuda.get_device_name()}",
        "",
        "| pair | cosine | max abs diff (std of the reference) | argmax equal |",
        "|---|---:|---:|---:|",
    ]

    def compare(name, a, b):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()
        diff = (a - b).abs().max().item() / b.std().item()
        same = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        lines.append(f"| {name} | {cos:.5f} | {diff:.4f} | {same:.0%} |")
        print(lines[-1], flush=True)

    hf32 = run_hf(hf)
    ours32 = run_ours(ours_of(hf))
    compare("ours fp32 vs transformers fp32", ours32, hf32)
    hf = hf.to(torch.bfloat16)
    gc.collect()
    torch.cuda.empty_cache()
    hf16 = run_hf(hf)
    ours16 = run_ours(ours_of(hf))
    compare("transformers bf16 vs transformers fp32", hf16, hf32)
    compare("ours bf16 vs transformers fp32", ours16, hf32)
    compare("ours bf16 vs ours fp32", ours16, ours32)
    compare("ours bf16 vs transformers bf16", ours16, hf16)
    lines += ["", f"({time.perf_counter() - t0:.0f} s, most of it fla-core's autotuning)"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
