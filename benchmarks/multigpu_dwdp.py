"""DWDP on GPUs: the peer link's peak, the project's expert fetch against it, and how much of the
fetch a prefill MoE layer's compute hides with two staging buffers (dwdp = world size, one GPU a
rank; DWDP: `tokenspeed.parallel.dwdp`, docs/parallel.md).

(a) Link peak, rank 0 -> rank 1: `Tensor.copy_` cuda:0 -> cuda:1 in rank 0's process (a
    copy-engine peer copy, cudaMemcpyPeerAsync-style, when peer access is on) and an NCCL
    send/recv of the same bytes. GB/s = 1e9 B/s.
(b) The project's fetch: `fetch_remote_experts` (what `DwdpFetcher` issues per MoE layer: one
    broadcast per member and projection, async, on apply_dwdp's fetch group) of one layer of
    decode_step's k3_slice() experts (56 x I 3072 x latent 3584, bf16, random) split as
    apply_dwdp splits them: GB/s of what a rank receives ((W-1)/W of the layer), the ratio to
    (a), and an all_gather of the same blocks for reference.
(c) Per tokens per rank, a stack of --layers such MoE layers (router, latent projections and
    norm, 2 shared experts, top-1 of 56 routed: the tokens per expert of K3's top-16 of 896)
    transformed by apply_dwdp. Per layer: compute with the remote experts already staged (no
    fetch); fetch alone (b); the stack with prefetch off; the stack as apply_dwdp runs it (it
    double-buffers: layer k + 1 fetched during layer k). Exposed fetch = a layer's time in the
    stack - its compute alone (so it includes the compute's slowdown while NCCL's kernels share
    the SMs): layer 0 (its fetch starts with the forward: nothing hides it) and the median of
    layers 1.. (steady state). DWDP experts compute with the grouped expert kernels on a GPU
    (`DwdpExperts._forward_fused`: the block held here, then the staging buffer; the torch
    reference on the CPU). (c) also runs apply_dwdp's schedule written out (wait for layer k's
    fetch, compute, issue layer k + 2's into the freed buffer; the same `fetch_remote_experts`
    calls and buffers) around a fused MoE of the same shapes holding all its experts: the
    cover a single fused kernel over both parts would give.
Each rank's median over --iters calls after --warmup, every call after a barrier (CUDA events;
the host clock on the CPU); tables show the slowest rank (the fetch couples the ranks). Layer
i + 1's fetch overlaps layer i's MoE only: in a model, attention adds to the cover.

    torchrun --nproc-per-node 2 benchmarks/multigpu_dwdp.py [--tokens 4096 8192 16384]
        [--layers 4] [--iters 10] [--peak-mib 1024] [--out FILE]
    python benchmarks/multigpu_dwdp.py --smoke      # 2 CPU ranks (gloo), tiny widths
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from multigpu_common import barrier, init_from_env, spawn_cpu_ranks
from tokenspeed.model import get_preset
from tokenspeed.model.init import fill_random_on_device
from tokenspeed.model.layers.moe import MoE
from tokenspeed.model.ops import dispatch
from tokenspeed.parallel import ParallelDims, ParallelGroups
from tokenspeed.parallel.dwdp import PROJECTIONS, apply_dwdp, fetch_remote_experts

DTYPE = torch.bfloat16
GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Marks:
    """Timestamps on the current stream (CUDA events) or the host clock; ms of each pair."""

    def __init__(self, device: torch.device):
        self.cuda, self.marks = device.type == "cuda", []

    def mark(self, *_) -> None:  # also a module pre-hook / forward hook
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """ms between marks 0-1, 2-3, ... (then forgets them)."""
        if self.cuda:
            torch.cuda.synchronize()
        m, self.marks = self.marks, []
        if self.cuda:
            return [m[i].elapsed_time(m[i + 1]) for i in range(0, len(m), 2)]
        return [(m[i + 1] - m[i]) * 1e3 for i in range(0, len(m), 2)]


def measure(fn, device, args, inner: Marks | None = None) -> tuple[float, list[float]]:
    """(median ms of a call, median ms of each span `inner` marks inside it): --iters calls
    after --warmup, each after a barrier of all ranks (every rank calls this, in order)."""
    whole, rows = Marks(device), []
    for i in range(args.warmup + args.iters):
        barrier(device)
        if inner is not None:
            inner.marks.clear()
        whole.mark()
        fn()
        whole.mark()
        row = (whole.spans()[0], inner.spans() if inner is not None else [])
        if i >= args.warmup:
            rows.append(row)
    per_span = [statistics.median(col) for col in zip(*(r[1] for r in rows), strict=True)]
    return statistics.median(r[0] for r in rows), per_span


class Stack(nn.Module):
    """MoE layers run one after the other on the same input (routing stays random)."""

    def __init__(self, config, layers: int):
        super().__init__()
        moe = config.moe
        self.layers = nn.ModuleList(
            MoE(config.hidden_size, moe, config.activation, config.rms_norm_eps)
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = layer(x)
        return y


def build(config, layers, device, seed, groups=None) -> Stack:
    """Random weights (N(0, 0.02), router fp32) on `device`; with `groups`, apply_dwdp first
    (on the meta device, as per-rank loading does: only this rank's block is allocated)."""
    with torch.device("meta"):
        stack = Stack(config, layers).to(DTYPE)
    if groups is not None:
        apply_dwdp(stack, groups)  # turns the one-device fused MoE off on its layers
    stack = fill_random_on_device(stack.to_empty(device=device), seed=seed)
    for layer in stack.layers:
        layer.gate.weight.data = layer.gate.weight.data.float()
        layer.gate.e_score_correction_bias = layer.gate.e_score_correction_bias.float()
    return stack.eval()


class Staged:
    """Stands in for the `DwdpFetcher`: the remote experts are already in the buffers."""

    def __init__(self, buffers):
        self.buffers = buffers

    def weights(self, k: int):
        return self.buffers[k % 2]

    def done(self, k: int) -> None:
        pass


def two_buffer(compute, fetch, layers: int, marks: Marks) -> None:
    """apply_dwdp's schedule written out: fetches of layers 0 and 1 issued first; layer k waits
    for its own, computes, then issues layer k + 2's into the buffer it frees."""
    works = {k: fetch(k) for k in range(min(2, layers))}
    for k in range(layers):
        marks.mark()
        for work in works.pop(k):
            work.wait()
        compute(k)
        marks.mark()
        if k + 2 < layers:
            works[k + 2] = fetch(k + 2)


def link_peak(rank, device, args, res) -> None:
    """(a): res["copy"] (rank 0), res["sendrecv"] (rank 1): ms per --peak-mib MiB."""
    n = args.peak_mib << 20
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    dst = None
    if rank == 0 and device.type == "cpu":
        dst = torch.empty_like(buf)  # smoke stand-in: a host copy
    elif rank == 0 and torch.cuda.device_count() > 1:
        peer = 1 if device.index != 1 else 0
        res["peer_access"] = torch.cuda.can_device_access_peer(device.index, peer)
        dst = torch.empty(n, dtype=torch.uint8, device=torch.device("cuda", peer))
    jobs = {"copy": lambda: dst.copy_(buf) if dst is not None else None}
    jobs["sendrecv"] = {0: lambda: dist.send(buf, 1), 1: lambda: dist.recv(buf, 0)}.get(rank)
    for name, fn in jobs.items():
        ms, _ = measure(fn or (lambda: None), device, args)
        if (name == "copy" and dst is not None) or (name == "sendrecv" and rank == 1):
            res[name] = ms


def gather_ms(local, world, handle, device, args) -> float:
    """(b)'s reference: ms of all_gathers of this rank's blocks of one layer (3 calls)."""
    gathered = torch.empty(world * local["w1"].numel(), dtype=DTYPE, device=device)

    def gather():
        for n in PROJECTIONS:
            GATHER(gathered, local[n].reshape(-1), group=handle)

    return measure(gather, device, args)[0]


@torch.no_grad()
def worker(rank: int, world: int, device: torch.device, args) -> None:
    if args.smoke:
        config = get_preset("tiny")
    else:
        from decode_step import k3_slice  # (its imports cost the smoke run seconds)

        config = k3_slice()
    res: dict = {}
    link_peak(rank, device, args, res)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the peak's buffers

    # (b) one layer's fetch, through the project's transport, into the project's buffers.
    groups = ParallelGroups.build(
        ParallelDims(world_size=world, dwdp=world), device, timeout=timedelta(seconds=args.timeout)
    )
    stack = build(config, args.layers, device, seed=rank, groups=groups)
    fetcher = stack.layers[0].experts.dwdp_fetcher
    buffers = fetcher._buffers()
    for buffer in buffers:  # what the compute-alone runs read
        for tensor in buffer.values():
            tensor.zero_()
    local = [{n: getattr(m.experts, n).detach() for n in PROJECTIONS} for m in stack.layers]

    def fetch(k):
        return fetch_remote_experts(
            local[k], buffers[k % 2], fetcher.group, fetcher.handle, async_op=True
        )

    def fetch_one():
        for work in fetch(0):
            work.wait()

    res["fetch"], _ = measure(fetch_one, device, args)
    res["gather"] = gather_ms(local[0], world, fetcher.handle, device, args)

    # (c) per tokens per rank.
    marks = Marks(device)
    for layer in stack.layers:
        layer.register_forward_pre_hook(marks.mark)
        layer.register_forward_hook(marks.mark)
    ref = build(config, 1, device, seed=world + rank).layers[0]
    staged = Staged(buffers)
    gen = torch.Generator(device=device).manual_seed(rank)
    for tokens in args.tokens:
        x = torch.randn(tokens, config.hidden_size, generator=gen, device=device, dtype=DTYPE)

        def alone(x=x):
            for layer in stack.layers:
                layer(x)

        def fused(k, x=x):
            ref(x)

        def fused_alone(fused=fused):
            for k in range(args.layers):
                marks.mark()
                fused(k)
                marks.mark()

        def fused_two(fused=fused):
            two_buffer(fused, fetch, args.layers, marks)

        for m in stack.layers:
            m.experts.dwdp_fetcher = staged
        _, compute = measure(alone, device, args, marks)
        for m in stack.layers:
            m.experts.dwdp_fetcher = fetcher
        fetcher.prefetch = False
        _, serial = measure(lambda x=x: stack(x), device, args, marks)
        fetcher.prefetch = True
        _, dwdp = measure(lambda x=x: stack(x), device, args, marks)
        _, f_compute = measure(fused_alone, device, args, marks)
        _, f_two = measure(fused_two, device, args, marks)
        for key, spans, base in (("dwdp", dwdp, compute), ("fused", f_two, f_compute)):
            res[tokens, key + "_compute"] = statistics.median(base)
            res[tokens, key + "_0"] = spans[0]
            res[tokens, key] = statistics.median(spans[1:])
            res[tokens, key + "_x0"] = spans[0] - base[0]
            exposed = [s - c for s, c in zip(spans[1:], base[1:], strict=True)]
            res[tokens, key + "_x"] = statistics.median(exposed)
        res[tokens, "serial"] = statistics.median(serial)
        res[tokens, "fused_path"] = dispatch.fused_moe(x)
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        report(args, device, world, config, fetcher, slowest_of(everyone))


def slowest_of(results: list[dict]) -> dict:
    """Each key's largest value over the ranks that have it."""
    out: dict = {}
    for res in results:
        for key, value in res.items():
            out[key] = max(out[key], value) if key in out else value
    return out


def versions(device, world) -> str:
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "absent"
    line = (
        f"date {datetime.now(UTC):%Y-%m-%d %H:%M UTC}, host {platform.node()}, "
        f"python {platform.python_version()}, torch {torch.__version__}, triton {triton}"
    )
    if device.type != "cuda":
        return f"{line}, {world} CPU ranks (gloo): the numbers say nothing about a GPU"
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    return (
        f"{line}, CUDA {torch.version.cuda}, NCCL {nccl}\n{world} ranks x "
        f"{torch.cuda.get_device_name(device)} ({torch.cuda.device_count()} visible)"
    )


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table (floats to 3 decimals) between blank lines."""
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    return ["", *lines, *("| " + " | ".join(map(_cell, row)) + " |" for row in rows), ""]


def report(args, device, world, config, fetcher, r) -> None:
    moe, nbytes, fetch = config.moe, fetcher.layer_fetch_bytes, r["fetch"]
    block, backend = moe.num_experts // world, dist.get_backend()
    peaks = {k: (args.peak_mib << 20) / r[k] / 1e6 for k in ("copy", "sendrecv") if k in r}
    peak = max(peaks.values())
    access = {True: ", peer access on", False: ", NO peer access"}.get(r.get("peer_access"), "")
    copy = "host copy (CPU stand-in)" if device.type == "cpu" else f"cuda:0 -> cuda:1{access}"
    rows = [[f"{backend} send/recv", r["sendrecv"], f"{peaks['sendrecv']:.4g}"]]
    if "copy" in r:
        rows.insert(0, [f"Tensor.copy_ {copy}", r["copy"], f"{peaks['copy']:.4g}"])
    out = [
        f"# DWDP: dwdp={world}, {config.name} experts",
        "",
        versions(device, world),
        "",
        f"Per MoE layer: {moe.num_experts} experts (I {moe.expert_intermediate_size} x "
        f"{moe.latent_size or config.hidden_size}, {DTYPE}, top-{moe.top_k}); a rank holds "
        f"{block}, fetches {moe.num_experts - block} = {nbytes / 1e6:.4g} MB; staging 2 x that. "
        f"{args.layers} layers; median of {args.iters} after {args.warmup} warm-up, slowest rank.",
        "",
        f"## (a) link peak, rank 0 -> rank 1, {args.peak_mib} MiB",
        *table(["path", "ms", "GB/s"], rows),
    ]
    if "copy" not in r:
        out.append("(no peer copy: one GPU visible per process)\n")
    rows = []
    for name, key in (
        (f"project: fetch_remote_experts, {world} x 3 {backend} broadcasts", "fetch"),
        ("reference: all_gather of the same blocks, 3 calls", "gather"),
    ):
        bw = nbytes / r[key] / 1e6
        rows.append([name, f"{nbytes / 1e6:.4g}", r[key], f"{bw:.4g}", f"{bw / peak:.0%}"])
    out += [
        "## (b) one MoE layer's remote experts, received per rank",
        *table(["path", "MB", "ms", "GB/s", "of best (a)"], rows),
        "## (c) per MoE layer, ms; exposed fetch = layer time in the stack - compute alone",
        "",
    ]
    fused = "fused Triton MoE" if r[args.tokens[0], "fused_path"] else "torch MoE (not fused)"
    for key, title in (
        ("dwdp", "Project DWDP layer as apply_dwdp leaves it (two buffers)"),
        (
            "fused",
            f"Two-buffer schedule written out around a {fused} of the same shapes (all "
            "experts local), the same fetch calls into the same buffers",
        ),
    ):
        serial = ["serial (prefetch off)"] if key == "dwdp" else []
        head = ["tokens/rank", "compute", "fetch", *serial, "layer 0", "steady", "exposed 0"]
        rows = []
        for t in args.tokens:
            x = r[t, f"{key}_x"]
            spans = [r[t, f"{key}_0"], r[t, key], r[t, f"{key}_x0"], x]
            hidden = f"{1 - max(x, 0) / fetch:.0%}"
            rows.append([t, r[t, f"{key}_compute"], fetch, *(r[t, "serial"] for _ in serial)])
            rows[-1] += [*spans, hidden]
        out += [f"{title}:", *table([*head, "exposed steady", "fetch hidden"], rows)]
    text = "\n".join(out)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per rank")
    p.add_argument("--layers", type=int, default=4, help="MoE layers in the stack (>= 3)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-mib", type=int, default=1024, help="bytes of the peak copies")
    p.add_argument("--timeout", type=float, default=600.0, help="s per collective (smoke: run)")
    p.add_argument("--out", help="also write the tables to this file")
    p.add_argument("--smoke", action="store_true", help="2 CPU ranks (gloo), tiny widths")
    args = p.parse_args()
    if args.smoke:
        args.tokens = args.tokens or [16, 48]
        args.iters, args.warmup, args.peak_mib = min(args.iters, 3), 1, 1
        args.timeout = min(args.timeout, 120.0)
    args.tokens = args.tokens or [4096, 8192, 16384]
    if args.layers < 3:
        p.error("--layers must be at least 3 (layer 0 and a steady state of two)")
    if args.smoke:
        spawn_cpu_ranks(worker, 2, args, timeout_s=args.timeout)
        return
    rank, world, device = init_from_env(cpu=False, timeout_s=args.timeout)
    try:
        if world < 2:
            raise SystemExit("DWDP needs at least 2 ranks (torchrun --nproc-per-node N, N >= 2)")
        worker(rank, world, device, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
