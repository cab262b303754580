"""K3 per-GPU memory and communication under the parallel layouts: the page docs/perf/parallel.md.

Every number comes from the closed forms of `tokenspeed.parallel.accounting` (pure arithmetic
over `get_preset("kimi-k3")`; nothing is allocated, no GPU needed):

    python benchmarks/parallel_memory.py                              # prints the page
    python benchmarks/parallel_memory.py --out docs/perf/parallel.md  # writes it
"""

from __future__ import annotations

import argparse
import datetime
import textwrap
from pathlib import Path

from tokenspeed.model import get_preset
from tokenspeed.model.config import ModelConfig
from tokenspeed.parallel.accounting import (
    GB,
    Layout,
    dep_layer_bytes,
    dep_rows_per_token,
    kda_state_elements,
    request_cache,
    table,
    tp_subgroup_layer_bytes,
    weight_bytes,
)
from tokenspeed.parallel.tp_subgroup import DEFAULT_PROJECTIONS

COMMAND = "python benchmarks/parallel_memory.py --out docs/perf/parallel.md"
TOKENS = 200_000
GPU_GB = 298
RESERVED_GB = 40


def _gb(n: float) -> str:
    return f"{n / GB:.1f}"


def _gb2(n: float) -> str:
    return f"{n / GB:.2f}"


def _kb(n: float) -> str:
    return f"{n / 1e3:.1f}"


def render(config: ModelConfig, date: str) -> str:
    rows = table(config, tokens=TOKENS, gpu_bytes=GPU_GB * GB, reserved=RESERVED_GB * GB)
    cache = request_cache(config, TOKENS)
    conv, recurrent = kda_state_elements(config)
    m, mla = config.moe, config.mla
    kda_layers, mla_layers = len(config.kda_layers), len(config.mla_layers)
    moe_layers = sum(k == "moe" for k in config.mlp_kinds)
    free = (GPU_GB - RESERVED_GB) * GB
    width = m.latent_size or config.hidden_size
    kda_moe = next(i for i, k in enumerate(config.layer_kinds) if k == "kda" and i > 0)
    mla_moe = config.mla_layers[0]
    replicated = weight_bytes(config, Layout("replicated"), rows[0].precision)
    lines = [
        "# Kimi K3 per GPU: weights, communication and requests per parallel layout",
        "",
        'What is computed: for `get_preset("kimi-k3")` ('
        f"{config.num_layers} layers: {kda_layers} KDA, {mla_layers} MLA, {moe_layers} MoE of "
        f"{m.num_experts} experts top-{m.top_k} at latent width {width}), per GPU of each layout: "
        "the weight bytes, the bytes one rank sends per local token per layer, and the "
        f"{TOKENS // 1000}k-token requests whose cache fits in what a {GPU_GB} GB GPU leaves after "
        f"the weights and {RESERVED_GB} GB of activations and workspace. Closed forms of "
        "`tokenspeed.parallel.accounting` (pure arithmetic over the config; the tests check them "
        "against the tiny model's transformed tensors, the loader's footprint and the issue's "
        "formulas). Not a measurement: no timing, no machine.",
        "",
        "Layouts: attention data parallel in all (every GPU holds its own requests and their "
        "whole cache). *TP T subgroups*: `apply_tp_subgroup`'s default projections "
        f"({', '.join(DEFAULT_PROJECTIONS)}) split by rows over T GPUs, routed experts "
        "replicated. *DEP R*: `apply_dep`, routed experts split over R GPUs. Precisions: "
        "(a) what K3 checkpoints store and our loader keeps: MXFP4 routed experts (E2M1 + an "
        "E8M0 scale per 32), BF16 elsewhere; (b) NVFP4 routed experts (E2M1 + an FP8 scale per "
        "16 + an fp32 scale per tensor), FP8 attention projections (every KDA/MLA linear; fp32 "
        "scales per 128x128 block), BF16 shared experts and the rest. In both, decay rates and the "
        "router stay fp32 (as loaded).",
        "",
        "## Reproduce",
        "",
        f"    {COMMAND}",
        "",
        f"- Date: {date} (the code as committed). Pure arithmetic: any machine gives this page.",
        f"- Per request at {TOKENS // 1000}k tokens: **{_gb2(cache.total)} GB** = FP8 MLA latent "
        f"cache {_gb2(cache.mla)} GB ({mla.latent_width} B a token in each of {mla_layers} MLA "
        f"layers) + drafter FP8 KV {_gb2(cache.drafter)} GB + two BF16 KDA checkpoints "
        f"{_gb2(cache.kda_checkpoints)} GB ({kda_layers} KDA layers x ({conv} conv + {recurrent} "
        "state) values x 2 B, x 2).",
        "",
        "## Results",
        "",
        "Communication columns: KB one GPU sends per local token per layer, the mean over all "
        f"{config.num_layers} layers (a DEP term is paid in the {moe_layers} MoE layers); "
        "activations and combine in BF16; KB = 10^3 bytes. *bound*: DEP dispatches every token "
        "to min(K, R-1) "
        "remote ranks (the issue's dispatch + combine <= 2K rows a token); *FP8 dispatch*: the "
        "same with FP8 dispatch rows; *uniform*: the mean number of remote ranks under uniform "
        "routing.",
        "",
        "| layout | precision | weights GB / GPU | KB / token / layer: bound | FP8 dispatch "
        f"| uniform | {TOKENS // 1000}k requests / GPU |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fits = r.weight_bytes <= free
        requests = str(r.requests) if fits else "weights do not fit"
        lines.append(
            f"| {r.layout.name} | {'(a)' if r.precision is rows[0].precision else '(b)'} "
            f"{r.precision.name} | {_gb(r.weight_bytes)} | {_kb(r.comm_per_layer)} | "
            f"{_kb(r.comm_per_layer_fp8)} | {_kb(r.comm_per_layer_expected)} | {requests} |"
        )
    dispatch, combine = dep_layer_bytes(config, 32, metadata=False)
    lines += [
        "",
        "## Known limits and why",
        "",
        f"- The replicated model is {_gb(replicated)} GB in (a): no TP-subgroup layout alone "
        f"fits; the routed experts ({m.num_experts} x 3 matrices in each of {moe_layers} layers) "
        "are nearly all of it, which only expert sharding divides.",
        "- Per-layer TP-subgroup bytes differ by layer kind: with T = 8, "
        f"{_kb(tp_subgroup_layer_bytes(config, kda_moe, 8))} KB in a KDA + MoE layer, "
        f"{_kb(tp_subgroup_layer_bytes(config, mla_moe, 8))} KB in an MLA + MoE layer. Each "
        "selected projection gathers its input ((T-1) x in) unless it shares the layer input's "
        "gather, and returns (T-1)/T of its output, so the gathers dominate (the output "
        f"projections' inputs are {config.kda.projection_size} wide). The issue's "
        "((T-1) + (T-1)/T) x H form is one square projection's share.",
        f"- DEP rows: DEP{8} sends at most {dep_rows_per_token(config, 8):.0f} rows a token "
        f"(7 remote ranks) where uniform routing gives {dep_rows_per_token(config, 8, True):.2f}; "
        f"at DEP32 the bound is K = {m.top_k} rows each way "
        f"({_kb(dispatch)} + {_kb(combine)} KB a token per MoE layer without metadata), "
        f"the mean {dep_rows_per_token(config, 32, True):.2f}. Dispatch rows also carry K fp32 "
        "weights + K int32 ids (and an fp32 scale with FP8), counted; the row counts exchanged "
        "per layer (R int64) are not. Real routing is not uniform: per-rank expert load "
        "(`dep.load_imbalance`) decides the busiest rank's bytes.",
        "- Equal token counts per rank are assumed (the TP-subgroup all-to-all sends the other "
        "members' tokens' columns; uneven counts shift bytes between members).",
        "- Drafter: assumed one EAGLE3-style decoder layer with MLA attention at the target's "
        f"shapes, so an FP8 latent cache of {mla.latent_width} B a token; its weights are not "
        "counted in the weight column.",
        "- KDA checkpoints are counted in BF16 as the issue asks; the engine keeps the recurrent "
        "state in fp32. A running request's live KDA state (conv BF16, state fp32: "
        f"{_gb2(cache.live_kda)} GB) is not in the per-request figure either; counting it "
        f"would make it {_gb2(cache.total + cache.live_kda)} GB.",
        f"- GB = 10^9 bytes; {GPU_GB} GB GPU, {RESERVED_GB} GB for activations and workspace "
        "(CUDA graphs, MoE buffers, staging) taken as given, not measured. Weights include the "
        "embedding and head (replicated), whose vocabulary sharding is not modelled.",
        "- FP8 attention weights and NVFP4 experts are accounted, not implemented: the loader "
        "refuses FP8 checkpoints and has no NVFP4 path (model/loader.py).",
    ]
    return "\n".join(_wrap(line) for line in lines) + "\n"


def _wrap(line: str, width: int = 100) -> str:
    """Prose and bullets wrapped at `width`; table rows and indented code as they are."""
    if line.startswith(("|", "    ")) or len(line) <= width:
        return line
    indent = "  " if line.startswith("- ") else ""
    return textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the page here instead of printing it")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    args = parser.parse_args()
    page = render(get_preset("kimi-k3"), args.date)
    if args.out:
        args.out.write_text(page)
    else:
        print(page, end="")


if __name__ == "__main__":
    main()
