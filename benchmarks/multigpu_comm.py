"""Multi-GPU communication at Kimi K3 widths, in one process group on the same inputs.

(2) --part comm: K3's MoE layer (896 experts, top 16, intermediate 3072, latent 3584 + norm, 2
    shared, hidden 7168; bf16, random weights) under `apply_dep` (DEP, ep = N) and `apply_tp`
    (TEP, tep = N); t tokens per GPU: a DEP rank runs its t, a TEP rank the group's N t.
    comm: DEP's count exchange (+ the layer's host sync), dispatch and combine; TEP's attention
    all-reduce [N t, hidden] and MoE all-reduce [N t, latent + hidden]. The layer's own calls,
    recorded during one forward, then replayed. layer: the transformed MoE module's forward.
(3) --part tp: the projections `apply_tp_subgroup` shards by default (readers of the hidden
    state, one shared all-gather, and o_proj) of a K3 KDA and a K3 MLA layer, replicated vs
    sharded over T in {2, 4} dividing N, t tokens on every rank; their weight bytes per GPU.

Eager on both sides: `DepMoE.routed` syncs the host for its row counts and loops over local
experts, `SubgroupLinear` syncs for the gathered counts, so neither can be captured in a CUDA
graph. Median per call over regions of --inner calls (CUDA events), each after a barrier of all
ranks, after --warmup calls; the slowest rank's median.

    torchrun --nproc-per-node N benchmarks/multigpu_comm.py [--part comm|tp|all]
        [--tokens 16 32 64 128 256] [--out FILE]                # N = 2, 4 or 8 GPUs (NCCL)
    python benchmarks/multigpu_comm.py --smoke [--out FILE]     # 2 CPU ranks, gloo, tiny preset

--smoke spawns its 2 CPU ranks (or runs under torchrun, on gloo): it checks the code paths and
the report; its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib
import importlib.util
import itertools
import math
import os
import platform
import sys
from datetime import UTC, datetime, timedelta
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

import tokenspeed.parallel.dep as dep_module
import tokenspeed.parallel.tp as tp_module
from decode_step import dtype_name, k3_slice
from multigpu_common import init_from_env, slowest, spawn_cpu_ranks, time_us
from tokenspeed.model import get_preset
from tokenspeed.model.init import fill_random_on_device
from tokenspeed.model.layers.kda import KdaAttention
from tokenspeed.model.layers.mla import GatedMla
from tokenspeed.model.layers.moe import MoE
from tokenspeed.parallel import (
    CommLog,
    ParallelDims,
    ParallelGroups,
    apply_dep,
    apply_tp,
    apply_tp_subgroup,
)
from tokenspeed.parallel.comm import all_reduce_
from tokenspeed.parallel.report import tensor_bytes
from tokenspeed.parallel.tp_subgroup import DEFAULT_PROJECTIONS as DEFAULTS
from tokenspeed.parallel.tp_subgroup import KDA_READS_HIDDEN, MLA_READS_HIDDEN

DTYPE = torch.bfloat16
MIB = 1 << 20


# --tokens, --warmup, --samples, --inner without / with --smoke.
RUN = {"tokens": [16, 32, 64, 128, 256], "warmup": 3, "samples": 20, "inner": 5}
SMOKE_RUN = {"tokens": [4, 8], "warmup": 1, "samples": 3, "inner": 1}


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def widths(smoke: bool):
    """(config of the layers, its name, the full model's layer kinds for per-model totals)."""
    if smoke:
        tiny = get_preset("tiny")
        return tiny, "tiny preset (smoke)", tiny.layer_kinds
    k3 = get_preset("kimi-k3")
    # decode_step's slice has K3's attention; its MoE is one rank's share: take K3's whole one.
    return k3_slice().evolve(moe=k3.moe), "Kimi K3 widths", k3.layer_kinds


def materialize(module: nn.Module, device: torch.device) -> nn.Module:
    """Random weights on `device` for a module built (and transformed) on the meta device.
    `fill_random_on_device` draws in parameter order from one seed: an MoE's router (its first
    parameter, also after apply_dep / apply_tp) is the same on every rank and on both sides."""
    module.to_empty(device=device)
    fill_random_on_device(module, seed=0)
    for m in module.modules():
        if isinstance(m, MoE):
            m.gate.float()  # the router stays fp32, as the loader keeps it
    return module.eval()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def rows(n: int, width: int, seed: int, device: torch.device) -> torch.Tensor:
    """The same [n, width] N(0, 1) rows on every rank (and for both sides)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=gen).to(device, DTYPE)


def record(layer, x, module, names: tuple[str, ...]) -> list:
    """Run `layer(x)` once and return its calls of `module.<name>` (the exchanges the layer
    looks up there), [(name, function, args, kwargs)] in the order of `names` (the layer's)."""
    with contextlib.ExitStack() as stack:
        real = {n: getattr(module, n) for n in names}
        spies = {n: stack.enter_context(mock.patch.object(module, n, wraps=real[n])) for n in names}
        layer(x)
    return [(n, real[n], c.args, c.kwargs) for n in names for c in spies[n].call_args_list]


def replay(calls: list):
    """The recorded exchanges again, as the layer made them (the count exchange followed by
    the host sync the layer makes on its result)."""

    def run():
        for name, fn, args, kwargs in calls:
            out = fn(*args, **kwargs)
            if name == "exchange_counts":
                out.tolist()

    return run


def measure_moe(kind: str, cfg, rank, world, device, args, timer) -> dict:
    """kind "dep" / "tep": tokens per GPU -> (comm us, layer us, bytes this rank sends)."""
    dep = kind == "dep"
    dims = ParallelDims(world_size=world, **{"ep" if dep else "tep": world})
    groups = ParallelGroups.build(dims, device, timeout=args.collective_timeout)
    with torch.device("meta"):
        moe = MoE(cfg.hidden_size, cfg.moe, cfg.activation, cfg.rms_norm_eps)
    holder = nn.ModuleDict({"moe": moe}).to(DTYPE)  # apply_tp replaces children of a parent
    log = CommLog()
    (apply_dep if dep else apply_tp)(holder, groups, log=log)
    layer = materialize(holder, device)["moe"]
    module = dep_module if dep else tp_module
    names = ("exchange_counts", "all_to_all_rows") if dep else ("all_reduce_",)
    out = {}
    with torch.no_grad():
        for t in args.tokens:
            x = rows(world * t, cfg.hidden_size, t, device)
            if dep:
                x = x[rank * t : (rank + 1) * t].contiguous()
            log.reset()
            calls = record(layer, x, module, names)
            if not dep:  # attention's all-reduce of its o_proj output, [N t, hidden]
                attn = torch.zeros(world * t, cfg.hidden_size, dtype=DTYPE, device=device)
                all_reduce_(attn, groups["tep"], log, tp_module.ATTN)
                calls.append(("all_reduce_", all_reduce_, (attn, groups["tep"]), {}))
            sent = log.total()
            comm_us = timer(replay(calls))
            layer_us = timer(lambda x=x, layer=layer: layer(x))
            out[t] = (comm_us, layer_us, sent)
            del calls, x
    del layer, holder, moe
    free(device)
    return out


def projections(layer: nn.Module):
    """(call over inputs x [t, hidden] and o [t, o_proj.in], the projection names): the
    `apply_tp_subgroup` defaults the layer has, readers of the hidden state on the same x."""
    reads = KDA_READS_HIDDEN if isinstance(layer, KdaAttention) else MLA_READS_HIDDEN
    names = [n for n in DEFAULTS if n in reads and getattr(layer, n, None) is not None]

    def run(x, o):
        for n in names:
            getattr(layer, n)(x)
        layer.o_proj(o)

    return run, [*names, "o_proj"]


def measure_tp(cfg, world, device, args, timer) -> tuple[list, list[int]]:
    """[(layer, T or None, {tokens: us}, projection weight bytes per GPU)], the T measured."""
    tps = [t for t in (2, 4) if t <= world and world % t == 0]
    groups = {
        t: ParallelGroups.build(
            ParallelDims(world_size=world, tp=t), device, timeout=args.collective_timeout
        )
        for t in tps
    }
    makers = {
        "KDA": lambda: KdaAttention(cfg.hidden_size, cfg.kda, cfg.rms_norm_eps),
        "MLA": lambda: GatedMla(cfg.hidden_size, cfg.mla),
    }
    results = []
    for name, make in makers.items():
        with torch.device("meta"):
            meta = make().to(DTYPE)
        for t in [None, *tps]:
            layer = copy.deepcopy(meta)
            if t is not None:
                apply_tp_subgroup(layer, groups[t])
            materialize(layer, device)
            run, names = projections(layer)
            weights = sum(tensor_bytes(getattr(layer, n)) for n in names)
            times = {}
            with torch.no_grad():
                for tokens in args.tokens:
                    x = rows(tokens, cfg.hidden_size, tokens, device)
                    o = rows(tokens, layer.o_proj.in_features, tokens + 1, device)
                    times[tokens] = timer(lambda x=x, o=o, run=run: run(x, o))
            results.append((name, t, times, weights))
            del layer, run
            free(device)
    return results, tps


def crossover(points: list[tuple[int, float]], cheaper: str, dearer: str) -> str:
    """Where a ratio (first side / second) crosses 1 between adjacent token counts,
    interpolated in log2(tokens); else which side wins throughout."""
    found = []
    for (t0, r0), (t1, r1) in itertools.pairwise(points):
        if (r0 - 1) * (r1 - 1) < 0:
            f = (1 - r0) / (r1 - r0)
            at = 2 ** (math.log2(t0) + f * (math.log2(t1) - math.log2(t0)))
            low = cheaper if r0 < 1 else dearer
            found.append(f"~{at:.0f} tokens/GPU (between {t0} and {t1}; {low} below)")
    if found:
        return "; ".join(found)
    first, last = points[0][0], points[-1][0]
    if all(r < 1 for _, r in points):
        return f"none in {first}-{last} tokens/GPU: {cheaper} throughout"
    if all(r > 1 for _, r in points):
        return f"none in {first}-{last} tokens/GPU: {dearer} throughout"
    return f"none in {first}-{last} tokens/GPU (ratio touches 1)"


def comm_table(dep: dict, tep: dict, world: int, cfg, shape: str) -> str:
    m = cfg.moe
    lines = [
        f"## (2) MoE layer communication: DEP (ep={world}) vs TEP (tep={world}), {shape}, "
        f"{world} ranks",
        "",
        f"One MoE layer: {m.num_experts} routed experts, top {m.top_k}, intermediate "
        f"{m.expert_intermediate_size}, latent {m.latent_size}, {m.num_shared_experts} shared, "
        f"hidden {cfg.hidden_size}, {dtype_name(DTYPE)}. t tokens per GPU: a DEP rank runs "
        f"its t, a TEP rank the group's {world} t. Eager on both sides (DEP cannot be "
        "captured). DEP comm: counts + dispatch + combine; TEP comm: attention and MoE "
        "all-reduces; layer: the transformed MoE module (TEP: with its MoE all-reduce). "
        "Ratios DEP / TEP: below 1, DEP is faster. Sent: payload bytes per rank (CommLog). "
        "Both sides' experts run the grouped expert kernels on a GPU (DEP: over the rows "
        "it received, `DepMoE._local_experts`).",
        "",
        "| tokens/GPU | DEP comm us | TEP comm us | DEP / TEP comm | DEP layer us "
        "| TEP layer us | DEP / TEP layer | DEP sent KiB | TEP sent KiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    comm_points, layer_points = [], []
    for t in sorted(dep):
        (dc, dl, ds), (tc, tl, ts) = dep[t], tep[t]
        comm_points.append((t, dc / tc))
        layer_points.append((t, dl / tl))
        lines.append(
            f"| {t} | {dc:.1f} | {tc:.1f} | {dc / tc:.3f} | {dl:.1f} | {tl:.1f} | {dl / tl:.3f} "
            f"| {ds / 1024:.1f} | {ts / 1024:.1f} |"
        )
    lines += [
        "",
        f"crossover (comm): {crossover(comm_points, 'DEP cheaper', 'TEP cheaper')}",
        f"crossover (layer): {crossover(layer_points, 'DEP faster', 'TEP faster')}",
    ]
    return "\n".join(lines)


def tp_table(results: list, tps: list[int], world: int, shape: str, kinds) -> str:
    lines = [
        f"## (3) TP subgroup projections vs replicated, {shape}, {world} ranks",
        "",
        "Projections of one layer: those the `apply_tp_subgroup` defaults shard (readers of the "
        "hidden state, one shared all-gather, and o_proj), t tokens on every rank, eager on "
        "both sides (SubgroupLinear syncs for the gathered counts). Ratio tp_subgroup / "
        "replicated: below 1, the subgroup is faster. Weights: those projections' bytes per GPU.",
        "",
        "| layer | T | tokens/GPU | replicated us | tp_subgroup us | subgroup / replicated "
        "| weights/GPU replicated MiB | tp_subgroup MiB | saved MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {name: (times, w) for name, t, times, w in results if t is None}
    notes, saved_model = [], {}
    for name, t, times, weights in results:
        if t is None:
            continue
        rep, rep_w = base[name]
        points = []
        for tokens in sorted(times):
            ratio = times[tokens] / rep[tokens]
            points.append((tokens, ratio))
            lines.append(
                f"| {name} | {t} | {tokens} | {rep[tokens]:.1f} | {times[tokens]:.1f} "
                f"| {ratio:.3f} | {rep_w / MIB:.2f} | {weights / MIB:.2f} "
                f"| {(rep_w - weights) / MIB:.2f} |"
            )
        cross = crossover(points, "tp_subgroup faster", "replicated faster")
        notes.append(f"crossover ({name}, T={t}): {cross}")
        count = kinds.count(name.lower())
        saved_model[t] = saved_model.get(t, 0) + count * (rep_w - weights)
    lines += ["", *notes]
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    for t, saved in saved_model.items():
        lines.append(
            f"saved per GPU over the whole model's attention projections ({n_kda} KDA + {n_mla} "
            f"MLA layers), T={t}: {saved / (1 << 30):.2f} GiB"
        )
    skipped = [t for t in (2, 4) if t not in tps]
    if skipped:
        lines.append(f"T={skipped} not measured: T must divide the {world} ranks")
    return "\n".join(lines)


def header(world: int, device: torch.device, shape: str) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        machine = f"{world} x {name}, NCCL {nccl}, CUDA {torch.version.cuda}"
    else:
        machine = f"{world} CPU ranks (gloo), smoke run: the numbers say nothing about a GPU"
    triton = importlib.import_module("triton").__version__ if has("triton") else "absent"
    one_sided = "installed; tokenspeed has no one-sided dispatch" if has("nvshmem") else None
    return "\n".join(
        [
            f"# Multi-GPU communication, {shape} (benchmarks/multigpu_comm.py)",
            "",
            f"machine: {machine}; host {platform.node()}",
            f"versions: torch {torch.__version__}, triton {triton}, python "
            f"{platform.python_version()}",
            f"date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
            f"one-sided dispatch (nvshmem4py): not measured ({one_sided or 'not installed'})",
        ]
    )


def run(rank: int, world: int, device: torch.device, args) -> None:
    """One rank: every measurement, in the same order on every rank; rank 0 reports."""
    args.collective_timeout = timedelta(seconds=args.timeout)
    torch.manual_seed(0)
    cfg, shape, kinds = widths(args.smoke)

    def timer(fn) -> float:
        us = time_us(fn, device, warmup=args.warmup, samples=args.samples, inner=args.inner)
        return slowest(us, device)

    sections = [header(world, device, shape)]
    if args.part in ("comm", "all"):
        dep = measure_moe("dep", cfg, rank, world, device, args, timer)
        tep = measure_moe("tep", cfg, rank, world, device, args, timer)
        sections.append(comm_table(dep, tep, world, cfg, shape))
    if args.part in ("tp", "all"):
        results, tps = measure_tp(cfg, world, device, args, timer)
        sections.append(tp_table(results, tps, world, shape, kinds))
    if rank == 0:
        text = "\n\n".join(sections)
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("comm", "tp", "all"), default="all")
    parser.add_argument("--tokens", type=int, nargs="+")
    for name in ("warmup", "samples", "inner"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--timeout", type=float, help="s per collective and per smoke run")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny widths")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    smoke = args.smoke
    for name, value in (SMOKE_RUN if smoke else RUN).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.tokens = sorted(args.tokens)
    args.timeout = args.timeout or (120.0 if smoke else 600.0)
    if "RANK" in os.environ:  # under torchrun
        if not smoke and not torch.cuda.is_available():
            print("multigpu_comm needs CUDA devices (or --smoke)", file=sys.stderr)
            return 2
        rank, world, device = init_from_env(cpu=smoke, timeout_s=args.timeout)
        try:
            if world < 2:
                raise SystemExit("multigpu_comm needs at least 2 ranks")
            run(rank, world, device, args)
        finally:
            dist.destroy_process_group()
        return 0
    if not smoke:
        print("run it under torchrun --nproc-per-node N, or pass --smoke", file=sys.stderr)
        return 2
    spawn_cpu_ranks(run, 2, args, timeout_s=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
