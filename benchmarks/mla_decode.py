"""MLA decode over a paged latent cache on one GPU: per-request KV splits vs uniform splits.

Claims (issue 7), all measured in one run, same process, same inputs:
  (a) mixed-history batches (36 requests drawn from 2k-200k; 64k/192k pairs): the split
      kernel with the planner's per-request split counts is >= 1.2x faster than the same kernel
      with a uniform split count; on equal-length controls with the same total KV it is no more
      than 5% slower;
  (b) achieved bandwidth (latent bytes read / time) >= 75% of a measured device copy bandwidth
      on large mixed batches (the table also gives TFLOP/s: at 96 heads the absorbed decode
      does ~181 flop per cache byte, past the H200's ridge point, so compute caps it: the run
      also times a bf16 matmul and prints what (b) asks of the tensor cores beside its rate);
  (c) against plain torch (absorbed form: per-request matmul + softmax + matmul) on the same
      inputs: the ratio.
Uniform baseline: S splits for every request, S = ceil(budget / B) at the same split budget as
the planner, and also the best S of a few multiples (the strongest uniform baseline). Timings
are CUDA-graph replays (the plan and lengths live in device buffers), median of 5 batches.

The run checks the kernel against the torch reference first (small K3-shaped case, every mode
timed below) and exits 1 on a mismatch.

    python benchmarks/mla_decode.py --out /tmp/mla_decode.md  # docs/perf/ pages are kept by hand
    TRITON_INTERPRET=1 python benchmarks/mla_decode.py --smoke   # CPU: code paths only
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from collections.abc import Callable

import attrs
import torch

from tokenspeed.model.ops.mla.decode import (
    MlaDecodeTuning,
    decode_parallelism,
    gluon_applies,
    mla_decode_paged_split,
    uniform_split_count,
)
from tokenspeed.model.ops.mla.reference import mla_decode_paged
from tokenspeed.model.ops.mla.split_plan import (
    SplitPlanBuffers,
    launch_order,
    min_split_capacity,
    plan_decode_splits,
)

GRAIN = 64  # planner granularity (page size)
TOL = 2e-2  # max |err| / max |ref|, bf16 (see tests/model/ops/test_mla_decode.py)


@attrs.frozen
class Dims:
    heads: int = 96
    rank: int = 512
    rope: int = 64
    nope: int = 128
    v_dim: int = 128
    page_size: int = 64

    @property
    def width(self) -> int:
        return self.rank + self.rope


SMOKE = Dims(heads=4, rank=32, rope=16, nope=16, v_dim=16, page_size=8)


@attrs.define
class Env:
    device: torch.device
    dims: Dims
    pool: torch.Tensor  # [NP, P, W] bf16, page 0 is the sink
    num_sms: int
    graphs: bool
    gen: torch.Generator


def timed(env: Env, fn: Callable[[], object], budget_ms: float = 60.0) -> float:
    """Milliseconds per call: CUDA-graph replays on the GPU (median of 5 batches)."""
    if not env.graphs:
        fn()
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _replay_ms(graph.replay, budget_ms)


def timed_eager(env: Env, fn: Callable[[], object], budget_ms: float = 200.0) -> float:
    fn()
    if not env.graphs:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    return _replay_ms(fn, budget_ms)


def _replay_ms(fn: Callable[[], object], budget_ms: float) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    iters = max(2, min(200, int(budget_ms / 5 / max(start.elapsed_time(end), 1e-3))))
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def copy_bandwidth(env: Env) -> float:
    """Device-to-device copy of 1 GiB, (read + write) bytes / time, in GB/s."""
    if not env.graphs:
        return float("nan")
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=env.device)
    dst = torch.empty_like(src)
    ms = _replay_ms(lambda: dst.copy_(src), 100.0)
    return 2 * src.numel() * 2 / ms / 1e6


def matmul_tflops(env: Env, size: int = 8192) -> float:
    """A square bf16 matmul (size^3, cuBLAS through torch): the tensor cores' practical rate,
    in TFLOP/s, to set (b)'s compute demand against."""
    if not env.graphs:
        return float("nan")
    a = torch.randn(size, size, dtype=torch.bfloat16, device=env.device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=env.device)
    c = torch.empty_like(a)
    ms = _replay_ms(lambda: torch.matmul(a, b, out=c), 200.0)
    return 2.0 * size**3 / ms / 1e9


def tflops_for_copy_fraction(dims: Dims, copy_gbs: float, fraction: float, rows: int) -> float:
    """TFLOP/s the absorbed decode must run at to stream the bf16 cache at `fraction` of copy
    bandwidth with `rows` query rows per cache row (one query: the heads, or the 64-row MMA
    programs' padded rows)."""
    cache_rows_per_s = fraction * copy_gbs * 1e9 / (dims.width * 2)
    return cache_rows_per_s * 2.0 * rows * (2 * dims.rank + dims.rope) / 1e12


@attrs.define
class Batch:
    lens: list[int]
    n: int
    heads: int
    q: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    gate: torch.Tensor
    page_table: torch.Tensor
    context_lens: torch.Tensor
    pages: torch.Tensor
    scales: torch.Tensor | None = None


def make_batch(
    env: Env, lens: list[int], n: int, heads: int | None = None, fp8: bool = False
) -> Batch:
    d, dev, g = env.dims, env.device, env.gen
    heads = heads or d.heads
    per_req = [-(-length // d.page_size) for length in lens]
    if sum(per_req) >= env.pool.shape[0]:
        raise ValueError("page pool too small for this batch")
    order = torch.randperm(env.pool.shape[0] - 1, generator=g)[: sum(per_req)] + 1
    table = torch.zeros(len(lens), max(per_req), dtype=torch.int32)
    used = 0
    for b, count in enumerate(per_req):  # ragged: each request's pages anywhere in the pool
        table[b, :count] = order[used : used + count].to(torch.int32)
        used += count

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(device=dev, dtype=env.pool.dtype)

    pages, scales = env.pool, None
    if fp8:
        # Random e4m3 values and per-row scales (correctness is checked on a small case).
        pages = env.pool.to(torch.float8_e4m3fn)
        scales = torch.rand(env.pool.shape[:2], generator=g).add(0.5).to(dev)
    return Batch(
        lens=lens,
        n=n,
        heads=heads,
        q=randn(len(lens) * n, heads, d.nope + d.rope),
        w_uk=randn(heads, d.nope, d.rank, std=d.nope**-0.5),
        w_uv=randn(heads, d.v_dim, d.rank, std=d.rank**-0.5),
        gate=randn(len(lens) * n, heads * d.v_dim),
        page_table=table.to(dev),
        context_lens=torch.tensor(lens, dtype=torch.int64, device=dev),
        pages=pages,
        scales=scales,
    )


def planner_buffers(env: Env, batch: Batch, parallelism: int) -> SplitPlanBuffers:
    b = len(batch.lens)
    bufs = SplitPlanBuffers.allocate(b, min_split_capacity(b, parallelism), device=env.device)
    plan_decode_splits(
        batch.lens,
        parallelism=parallelism,
        max_batch=b,
        max_splits=bufs.max_splits,
        granularity=GRAIN,
        out=bufs,
    )
    return bufs


def kernel(
    env: Env,
    batch: Batch,
    splits=None,
    uniform: int | None = None,
    tiles: MlaDecodeTuning | None = None,
    which: str | None = None,
) -> Callable[[], torch.Tensor]:
    """The decode call on this batch; tiles: the tuning (None: the defaults), with its kernel
    set to `which` when given."""
    scale = (env.dims.nope + env.dims.rope) ** -0.5
    tuning = tiles or MlaDecodeTuning()
    if which is not None:
        tuning = attrs.evolve(tuning, kernel=which)

    def call() -> torch.Tensor:
        return mla_decode_paged_split(
            batch.q,
            batch.pages,
            batch.page_table,
            batch.context_lens,
            batch.w_uk,
            batch.w_uv,
            scale,
            splits,
            uniform_splits=uniform,
            gate=batch.gate,
            page_scales=batch.scales,
            tuning=tuning,
        )

    return call


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as uint8 for indexing (gather kernels need not support float8 types)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def torch_absorbed(env: Env, batch: Batch) -> Callable[[], torch.Tensor]:
    """Plain torch on the same inputs: absorb, then per request gather its rows, matmul,
    fp32 softmax (causal over the last n), matmul; then W_UV and the gate."""
    d, n, h = env.dims, batch.n, batch.heads
    scale = (d.nope + d.rope) ** -0.5
    pages_of = [
        batch.page_table[b, : -(-length // d.page_size)].long()
        for b, length in enumerate(batch.lens)
    ]
    masks = []
    for length in batch.lens:
        pos = torch.arange(length, device=env.device)
        last = length - n + torch.arange(n, device=env.device)
        masks.append((pos[None, :] > last[:, None]).repeat_interleave(h, 0))  # [n * H, L]

    def call() -> torch.Tensor:
        q_lat = torch.bmm(batch.q[..., : d.nope].transpose(0, 1), batch.w_uk).transpose(0, 1)
        q_all = torch.cat([q_lat, batch.q[..., d.nope :]], -1)  # [T, H, W]
        outs = []
        for b, length in enumerate(batch.lens):
            rows = bytes_view(batch.pages)[pages_of[b]].view(batch.pages.dtype)
            rows = rows.view(-1, d.width)[:length]
            if batch.scales is not None:
                s = batch.scales[pages_of[b]].view(-1)[:length]
                rows = (rows.float() * s[:, None]).to(q_all.dtype)
            qb = q_all[b * n : (b + 1) * n].reshape(n * h, d.width)
            scores = (qb @ rows.t()).float().mul_(scale).masked_fill_(masks[b], float("-inf"))
            outs.append(scores.softmax(-1).to(qb.dtype) @ rows[:, : d.rank])
        o_lat = torch.stack(outs).view(len(batch.lens) * n, h, d.rank)
        o = torch.bmm(o_lat.transpose(0, 1), batch.w_uv.transpose(1, 2)).transpose(0, 1)
        return o * torch.sigmoid(batch.gate.view_as(o))

    return call


def reference_out(env: Env, batch: Batch) -> torch.Tensor:
    # Only the batch's pages, dequantized (the pool is gigabytes): renumber the table.
    used, table = batch.page_table.unique(return_inverse=True)
    pages = bytes_view(batch.pages)[used].view(batch.pages.dtype).float()
    if batch.scales is not None:
        pages = pages * batch.scales[used][:, :, None]
    scale = (env.dims.nope + env.dims.rope) ** -0.5
    ref = mla_decode_paged(
        batch.q.float(),
        pages,
        table,
        batch.context_lens,
        batch.w_uk.float(),
        batch.w_uv.float(),
        scale,
    )
    return ref * torch.sigmoid(batch.gate.float().view_as(ref))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def check(env: Env, tiles_list: list[MlaDecodeTuning | None]) -> list[str]:
    """Every mode timed below against the reference on a small batch; returns failures."""
    scale = 1 if env.dims.heads > 8 else 0.05
    lens = [max(4, int(x * scale)) for x in (3000, 64, 700, 5)]
    failures = []
    for n, fp8, heads in ((1, False, None), (4, False, None), (1, True, None), (1, False, 32)):
        if heads and env.dims.heads <= 8:
            heads = 8
        batch = make_batch(env, lens, n, heads=heads, fp8=fp8)
        ref = reference_out(env, batch)
        par = decode_parallelism(env.num_sms, batch.heads, n)
        modes = [
            ("per-request", kernel(env, batch, planner_buffers(env, batch, par), tiles=t))
            for t in tiles_list
        ]
        modes += [
            ("uniform", kernel(env, batch, uniform=7)),
            ("uniform as a plan", kernel(env, batch, uniform_plan(env, lens, 3))),
            ("torch", torch_absorbed(env, batch)),
        ]
        for name, fn in modes:
            err = rel_err(fn(), ref)
            tag = f"{name} n={n} fp8={fp8} heads={batch.heads}"
            print(f"check {tag}: rel err {err:.2e}")
            if not err <= TOL:
                failures.append(f"{tag}: {err:.2e}")
    return failures


@attrs.define
class Row:
    name: str
    kind: str  # "mixed", "control" or "variant": which target the row speaks to
    n: int
    heads: int
    rows: int
    bytes_read: int
    flops: float
    budget: int  # the planner's split budget P (best of the waves tried)
    per_request_ms: float
    uniform_ms: float  # classic uniform mode, S = ceil(P / B)
    uniform_plan_ms: float  # the same S as a plan, launched longest first like the planner's
    uniform_best_ms: float
    uniform_best_s: int


def uniform_plan(env: Env, lens: list[int], splits: int) -> SplitPlanBuffers:
    """The uniform split (S per request, lengths rounded up to GRAIN) in the planner's format,
    so that it runs through exactly the planner's code path and launch order."""
    b = len(lens)
    bufs = SplitPlanBuffers.allocate(b, b * splits)
    starts, sizes, owner = [], [], []
    for row, length in enumerate(lens):
        per_split = -(-length // splits)
        chunk = -(-per_split // GRAIN) * GRAIN
        for i in range(splits):
            if i * chunk < length:
                starts.append(i * chunk)
                sizes.append(min(chunk, length - i * chunk))
                owner.append(row)
        bufs.num_splits[row] = len(owner) - int(bufs.split_indptr[row])
        bufs.split_indptr[row + 1] = len(owner)
    used = len(owner)
    bufs.split_row[:used] = torch.tensor(owner, dtype=torch.int32)
    bufs.split_start[:used] = torch.tensor(starts, dtype=torch.int32)
    bufs.split_len[:used] = torch.tensor(sizes, dtype=torch.int32)
    bufs.split_order.copy_(torch.tensor(launch_order(bufs.split_len.tolist()), dtype=torch.int32))
    return SplitPlanBuffers(*(t.to(env.device) for t in attrs.astuple(bufs, recurse=False)))


def measure(
    env: Env,
    name: str,
    lens: list[int],
    kind: str,
    n: int = 1,
    heads: int | None = None,
    fp8: bool = False,
    waves: tuple[int, ...] = (1, 2, 4),
) -> Row:
    batch = make_batch(env, lens, n, heads=heads, fp8=fp8)
    b = len(lens)
    budgets = sorted({decode_parallelism(env.num_sms, batch.heads, n, waves=w) for w in waves})
    planned = {p: timed(env, kernel(env, batch, planner_buffers(env, batch, p))) for p in budgets}
    best_budget = min(planned, key=planned.get)
    s0 = uniform_split_count(b, best_budget)
    uniform = {}
    for s in sorted({s0, *(uniform_split_count(b, p) for p in budgets), 2 * s0, 4 * s0}):
        uniform[s] = timed(env, kernel(env, batch, uniform=s))
    as_plan = timed(env, kernel(env, batch, uniform_plan(env, lens, s0)))
    best_s = min(uniform, key=uniform.get)
    elem = 1 if fp8 else 2
    print(
        f"{name}: per-request "
        + ", ".join(f"P={p}: {ms:.3f}" for p, ms in planned.items())
        + " ms; uniform "
        + ", ".join(f"S={s}: {ms:.3f}" for s, ms in uniform.items())
        + f" ms; uniform S={s0} as a plan: {as_plan:.3f} ms"
    )
    return Row(
        name=name,
        kind=kind,
        n=n,
        heads=batch.heads,
        rows=sum(lens),
        bytes_read=sum(lens) * env.dims.width * elem + (sum(lens) * 4 if fp8 else 0),
        # Per row, query and head: QK over R + Dr and PV over R multiply-adds.
        flops=2.0 * sum(lens) * n * batch.heads * (2 * env.dims.rank + env.dims.rope),
        budget=best_budget,
        per_request_ms=planned[best_budget],
        uniform_ms=uniform[s0],
        uniform_plan_ms=as_plan,
        uniform_best_ms=uniform[best_s],
        uniform_best_s=best_s,
    )


def draw(gen: torch.Generator, count: int, lo: int, hi: int, log: bool) -> list[int]:
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    if log:
        return [int(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo)))) for x in u]
    return [int(lo + x * (hi - lo)) for x in u]


def equal_control(lens: list[int]) -> list[int]:
    """Same batch size and the same total rows, equal lengths."""
    b, total = len(lens), sum(lens)
    return [total // b + (1 if i < total % b else 0) for i in range(b)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny dims and lengths (CPU interpreter): exercise the code only",
    )
    args = parser.parse_args()

    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke under TRITON_INTERPRET=1)")
        return 2
    device = torch.device("cpu" if smoke else "cuda")
    dims = SMOKE if smoke else Dims()
    k = 1e-3 if smoke else 1.0  # length scale
    L = lambda x: max(dims.page_size, int(x * k))  # noqa: E731
    gen = torch.Generator().manual_seed(args.seed)

    mixed = [L(x) for x in draw(gen, 36, 2_000, 200_000, log=False)]
    mixed_log = [L(x) for x in draw(gen, 36, 2_000, 200_000, log=True)]
    pair = [L(65_536), L(196_608)]
    pairs8 = pair * 8
    max_rows = max(sum(x) for x in (mixed, mixed_log, pairs8)) + 4 * L(3000)
    num_pages = max_rows // dims.page_size + 64 * 36 + 1
    pool_dtype = torch.float32 if smoke else torch.bfloat16
    pool = torch.randn(
        num_pages, dims.page_size, dims.width, dtype=pool_dtype, device=device, generator=None
    )
    pool[0] = 0.0
    num_sms = 4 if smoke else torch.cuda.get_device_properties(device).multi_processor_count
    env = Env(device=device, dims=dims, pool=pool, num_sms=num_sms, graphs=not smoke, gen=gen)
    name = "CPU interpreter (smoke)" if smoke else torch.cuda.get_device_name(device)
    print(f"device: {name}, {num_sms} SMs, pool {pool.numel() * pool.element_size() / 1e9:.1f} GB")

    rows_per_req = dims.heads
    sweep = (
        [None]
        if smoke
        else [
            None,
            MlaDecodeTuning(block_m=32, block_n=32, num_warps=8, num_stages=2),
            MlaDecodeTuning(block_m=64, block_n=32, num_warps=8, num_stages=3),
            MlaDecodeTuning(block_m=64, block_n=64, num_warps=8, num_stages=2),
        ]
    )
    failures = check(env, sweep[:1])
    if failures:
        print("MISMATCH against the reference:\n  " + "\n  ".join(failures))
        return 1

    copy_gbs = copy_bandwidth(env)
    print(f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s")
    mm_tflops = matmul_tflops(env)
    print(f"bf16 matmul 8192^3: {mm_tflops:.0f} TFLOP/s")

    # Tile sweep on the large mixed batch (per-request splits), each config checked first.
    sweep_lines = []
    big = make_batch(env, mixed, 1)
    for tiles in sweep:
        # The Triton kernel's tiles, resolved (explicit tiles keep the Triton kernel).
        t = (tiles or MlaDecodeTuning()).resolve(rows_per_req, on_gpu=not smoke)
        par = decode_parallelism(num_sms, dims.heads, 1, tiles=t)
        label = f"m{t.block_m} n{t.block_n} w{t.num_warps} s{t.num_stages}"
        try:
            small = make_batch(env, [L(3000), L(64), L(700)], 1)
            fn = kernel(env, small, planner_buffers(env, small, par), tiles=t)
            err = rel_err(fn(), reference_out(env, small))
            if not err <= TOL:
                sweep_lines.append(f"| {label} | mismatch {err:.1e} | |")
                failures.append(f"tiles {label}: {err:.2e}")
                continue
            ms = timed(env, kernel(env, big, planner_buffers(env, big, par), tiles=t))
            gbs = sum(mixed) * dims.width * 2 / ms / 1e6
            sweep_lines.append(
                f"| {label}{' (default)' if tiles is None else ''} | {ms:.3f} | {gbs:.0f} |"
            )
        except Exception as exc:  # a config that does not fit (shared memory) is reported
            sweep_lines.append(f"| {label} | failed: {type(exc).__name__} | |")
        print(sweep_lines[-1])
    del big

    table = []
    for label, lens in (
        ("mixed36 uniform draw 2k-200k", mixed),
        ("mixed36 log-uniform draw 2k-200k", mixed_log),
        ("pair 64k/192k", pair),
        ("8 pairs 64k/192k", pairs8),
    ):
        table.append(measure(env, label, lens, "mixed"))
        control = equal_control(lens)
        name_c = f"  control: {len(control)} x {control[0]}"
        table.append(measure(env, name_c, control, "control"))
    table += [
        measure(env, "mixed36, 4 verify queries", mixed, "variant", n=4),
        measure(env, "mixed36, FP8 per-row scales", mixed, "variant", fp8=True),
        measure(
            env, "mixed36, 32 heads (Kimi Linear)", mixed, "variant", heads=min(32, dims.heads)
        ),
    ]

    # The split kernel itself: Gluon (the default on Hopper for bf16) vs the Triton kernel, same
    # plan (per-request splits at the default budget), same inputs.
    kernel_lines = []
    for label, lens, n, heads, fp8 in (
        ("mixed36 uniform draw", mixed, 1, None, False),
        ("mixed36 log-uniform draw", mixed_log, 1, None, False),
        ("8 pairs 64k/192k", pairs8, 1, None, False),
        ("mixed36, 4 verify queries", mixed, 4, None, False),
        ("mixed36, FP8 per-row scales", mixed, 1, None, True),
        ("mixed36, 32 heads", mixed, 1, min(32, dims.heads), False),
    ):
        batch = make_batch(env, lens, n, heads=heads, fp8=fp8)
        if smoke or not gluon_applies(
            batch.q, batch.pages, batch.scales, dims.rank, dims.rope, dims.page_size
        ):
            kernel_lines.append(f"| {label} | - | - | Gluon kernel not applicable here |")
            continue
        bufs = planner_buffers(env, batch, decode_parallelism(num_sms, batch.heads, n))
        ms = {w: timed(env, kernel(env, batch, bufs, which=w)) for w in ("triton", "gluon")}
        row_bytes = dims.width + 4 if fp8 else 2 * dims.width  # e4m3 row + its fp32 scale
        gbs = sum(lens) * row_bytes / ms["gluon"] / 1e6
        kernel_lines.append(
            f"| {label} | {ms['triton']:.3f} | {ms['gluon']:.3f} | "
            f"{ms['triton'] / ms['gluon']:.2f}x | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |"
        )
        print(kernel_lines[-1])

    # (c) plain torch on the same inputs (eager; it is a loop over requests).
    torch_lines = []
    for label, lens in (("mixed36 uniform draw", mixed), ("pair 64k/192k", pair)):
        batch = make_batch(env, lens, 1)
        par = decode_parallelism(num_sms, dims.heads, 1)
        ours = timed(env, kernel(env, batch, planner_buffers(env, batch, par)))
        base = timed_eager(env, torch_absorbed(env, batch))
        torch_lines.append(f"| {label} | {base:.3f} | {ours:.3f} | {base / ours:.1f}x |")
        print(torch_lines[-1])

    stamp = datetime.date.today().isoformat()
    out = [
        f"MLA decode, {name}, {stamp}. Copy bandwidth (read + write, 1 GiB): {copy_gbs:.0f} GB/s.",
        "",
        "Per-request: the planner at the best of 1, 2, 4 waves of split budget P; uniform: S ="
        " ceil(P / B) splits per request (classic in-kernel mode, and the same S as a plan"
        " launched longest first); speedup = uniform time / per-request time.",
        "",
        "| batch | n | heads | rows | per-request ms (P) | uniform ms | speedup | "
        "uniform as plan ms | speedup | uniform best ms (S) | speedup | GB/s | % of copy | "
        "TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        gbs = r.bytes_read / r.per_request_ms / 1e6
        base = r.per_request_ms
        out.append(
            f"| {r.name} | {r.n} | {r.heads} | {r.rows} | {base:.3f} ({r.budget}) | "
            f"{r.uniform_ms:.3f} | {r.uniform_ms / base:.2f}x | {r.uniform_plan_ms:.3f} | "
            f"{r.uniform_plan_ms / base:.2f}x | {r.uniform_best_ms:.3f} ({r.uniform_best_s}) | "
            f"{r.uniform_best_ms / base:.2f}x | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | "
            f"{r.flops / base / 1e9:.0f} |"
        )
    out += [
        "",
        "Tile sweep of the Triton split kernel (mixed36 uniform draw, per-request splits,"
        " default budget of 4 waves):",
        "",
        "| tiles | ms | GB/s |",
        "|---|---|---|",
        *sweep_lines,
        "",
        "Split kernel: the Triton kernel vs the Gluon kernel (the default on Hopper), per-request"
        " splits at the default budget, whole decode call (graph):",
        "",
        "| batch | Triton ms | Gluon ms | Gluon speed-up | Gluon GB/s | % of copy |",
        "|---|---|---|---|---|---|",
        *kernel_lines,
        "",
        "Plain torch absorbed decode (eager) vs the split kernel (graph), n = 1:",
        "",
        "| batch | torch ms | kernel ms | ratio |",
        "|---|---|---|---|",
        *torch_lines,
    ]
    # Verdicts on the targets (performance, so they do not change the exit status).
    mixed_rows = [r for r in table if r.kind == "mixed"]
    controls = [r for r in table if r.kind == "control"]
    speedups = [r.uniform_ms / r.per_request_ms for r in mixed_rows]
    control_ratios = [r.uniform_ms / r.per_request_ms for r in controls]
    large = [r for r in mixed_rows if r.rows >= 1_000_000 * k]
    fractions = [r.bytes_read / r.per_request_ms / 1e6 / copy_gbs for r in large]
    out += [
        "",
        "Targets:",
        "",
        f"- (a) per-request vs uniform at the same budget on mixed batches: "
        f"{', '.join(f'{x:.2f}x' for x in speedups)} (target >= 1.2x: "
        f"{'met' if min(speedups) >= 1.2 else 'not met'})",
        f"- (a) equal-length controls, uniform / per-request time: "
        f"{', '.join(f'{x:.2f}' for x in control_ratios)} (target >= 0.95: "
        f"{'met' if min(control_ratios) >= 0.95 else 'not met'})",
        f"- (b) bandwidth on large mixed batches (K3, 96 heads): "
        f"{', '.join(f'{100 * x:.0f}%' for x in fractions)} of copy (target >= 75%: "
        f"{'met' if fractions and min(fractions) >= 0.75 else 'not met'})",
    ]
    # At 96 heads the decode is compute-bound: what (b) asks of the tensor cores, next to a
    # plain matmul's rate on the same device in the same run.
    padded = -(-dims.heads // 64) * 64
    need = [tflops_for_copy_fraction(dims, copy_gbs, 0.75, r) for r in (dims.heads, padded)]
    out.append(
        f"- (b)'s demand: 75% of copy at {dims.heads} heads is {need[0]:.0f} TFLOP/s on "
        f"{dims.heads} query rows ({100 * need[0] / mm_tflops:.0f}% of this run's bf16 matmul "
        f"8192^3, {mm_tflops:.0f} TFLOP/s), {need[1]:.0f} on the {padded} rows of 64-row MMA "
        f"programs ({100 * need[1] / mm_tflops:.0f}%)"
    )
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if failures:
        print("MISMATCH:", failures)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
