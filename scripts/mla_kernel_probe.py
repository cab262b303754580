"""Probe: the MLA split kernels' launch shapes on the H200 (not a benchmark of record;
benchmarks/mla_decode.py is).

Times the whole decode call (absorb + split kernel + merge tail) on the large mixed batch of
benchmarks/mla_decode.py (36 histories drawn from 2k-200k) for configs
"kind,bm,bn,warps,stages[,chunk]":
  orig - the Triton split kernel (`decode._split_kernel`) at BLOCK_M bm, BLOCK_N bn
  G    - the Gluon kernel (`gluon_decode`) with BN bn and `stages` shared-memory stages and TMA
         chunks of `chunk` latent columns (0: the default), every row block padded to 64
  GT   - the same, with a 32-row remainder (96 heads) in `gluon_transposed` after it
  GTS  - GT with the remainder kernel on a side stream (both grids share the SMs)
  W/WT - the library call `mla_decode_paged_split(kernel="gluon" / "triton")` at its defaults
Each config is first checked on a small ragged case whose splits start mid-tile (granularity
16), then on the large batch, against the torch reference.

    PYTHONPATH=src:benchmarks:scripts python3 scripts/mla_kernel_probe.py \
        [--heads 32] [--verify 4] [--configs "orig,64,64,8,2 G,64,64,8,2"] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import torch
import triton

import mla_decode as bench
from tokenspeed.model.ops.mla import decode as md

LOG2E = md.LOG2E


@functools.cache
def side_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()


def run(kind, batch, env, bufs, order, bm, bn, warps, stages, chunk=0):
    d = env.dims
    q, pages = batch.q, batch.pages
    tokens, heads, _ = q.shape
    n = tokens // len(batch.lens)
    rows = n * heads
    scale = (d.nope + d.rope) ** -0.5
    if kind in ("W", "WT"):  # the library call, Gluon or Triton kernel
        return md.mla_decode_paged_split(
            q,
            pages,
            batch.page_table,
            batch.context_lens,
            batch.w_uk,
            batch.w_uv,
            scale,
            bufs,
            gate=batch.gate,
            split_order=order,
            page_scales=batch.scales,
            kernel="gluon" if kind == "W" else "triton",
        )
    q_lat = torch.bmm(q[..., : d.nope].transpose(0, 1), batch.w_uk)
    q_rope = q[..., d.nope :]
    slots = bufs.split_len.numel()
    part_o = torch.empty(slots, rows, d.rank, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(slots, rows, dtype=torch.float32, device=q.device)
    meta = (order, bufs.split_row, bufs.split_start, bufs.split_len)
    common = (
        q_lat.stride(1),
        q_lat.stride(0),
        q_rope.stride(0),
        q_rope.stride(1),
        pages.stride(0),
        batch.page_table.stride(0),
        1,
    )
    # Both split kernels take the same arguments after their cache operands.
    args = (batch.page_table, batch.context_lens, *meta, part_o, part_lse, scale * LOG2E, *common)
    shape = dict(
        NUM_HEADS=heads,
        N_QUERY=n,
        RANK=d.rank,
        ROPE=d.rope,
        PAGE_SIZE=d.page_size,
        UNIFORM=False,
        GRANULE=64,
        SCALE_MODE=0,
    )
    if kind.startswith("G"):
        from tokenspeed.model.ops.mla import gluon_decode as gd
        from tokenspeed.model.ops.mla import gluon_ring
        from tokenspeed.model.ops.mla import gluon_transposed as gtr

        dc, dr = gluon_ring.descriptors(pages, d.rank, bn, chunk or None)
        # part_lse stands in for the row scales, unused with a bf16 cache
        operands = (q_lat, q_rope, pages, part_lse, dc, dr, *args)
        full, rest = divmod(rows, gd.BLOCK_M)
        transposed = kind != "G" and rest == gtr.BLOCK_ROWS
        blocks = full if transposed else triton.cdiv(rows, gd.BLOCK_M)
        if blocks:
            gd._split_kernel_gluon[(blocks, slots)](*operands, **shape, STAGES=stages, num_warps=8)
        if transposed:
            # GTS: on a side stream, so that it shares the SMs with the 64-row programs
            # instead of starting after their last one.
            side = side_stream() if kind == "GTS" and blocks else None
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                gtr._split_kernel_transposed[(1, slots)](
                    *operands,
                    **shape,
                    STAGES=stages,
                    ROW0=full * gd.BLOCK_M,
                    num_warps=4,
                )
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
    else:
        md._split_kernel[(triton.cdiv(rows, bm), slots)](
            q_lat,
            q_rope,
            pages,
            part_lse,
            *args,
            **shape,
            BLOCK_M=bm,
            BLOCK_N=bn,
            USE_PDL=False,
            num_warps=warps,
            num_stages=stages,
        )
    out = torch.empty(tokens, heads, d.v_dim, dtype=q.dtype, device=q.device)
    gate = batch.gate.view(tokens, heads, d.v_dim)
    block_t = 16 if tokens <= 128 else 32
    md._tail_kernel[(triton.cdiv(tokens, block_t), heads)](
        part_o,
        part_lse,
        bufs.num_splits,
        bufs.split_indptr,
        batch.w_uv,
        gate,
        out,
        tokens,
        1,
        batch.w_uv.stride(0),
        batch.w_uv.stride(1),
        gate.stride(0),
        gate.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=heads,
        N_QUERY=n,
        RANK=d.rank,
        V_DIM=d.v_dim,
        BLOCK_T=block_t,
        BLOCK_R=min(d.rank, 128),
        HAS_GATE=True,
        UNIFORM=False,
        USE_PDL=False,
        num_warps=4,
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--configs", default="")
    ap.add_argument("--heads", type=int, default=0)
    ap.add_argument("--verify", type=int, nargs="*", default=[])
    ap.add_argument("--fp8", action="store_true", help="e4m3 cache with per-row scales (W/WT)")
    ap.add_argument(
        "--convert-cols",
        type=int,
        default=0,
        help="with --fp8: `gluon_decode.FP8_CONVERT_COLS` for the library call (0: its default)",
    )
    args = ap.parse_args()
    from tokenspeed.model.ops.mla import gluon_decode

    if args.convert_cols:
        gluon_decode.FP8_CONVERT_COLS = args.convert_cols
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    dims = (
        bench.Dims(heads=8, rank=64, rope=16, nope=16, v_dim=16, page_size=16)
        if smoke
        else bench.Dims()
    )
    if args.heads:
        dims = bench.Dims(heads=args.heads)
    gen = torch.Generator().manual_seed(0)
    mixed = [37, 16, 100, 5, 64] if smoke else bench.draw(gen, 36, 2_000, 200_000, log=False)
    pages = sum(-(-x // dims.page_size) for x in mixed) + 64
    dtype = torch.float32 if smoke else torch.bfloat16
    pool = torch.randn(pages, dims.page_size, dims.width, dtype=dtype, device=dev)
    pool[0] = 0
    sms = 4 if smoke else torch.cuda.get_device_properties(dev).multi_processor_count
    env = bench.Env(device=dev, dims=dims, pool=pool, num_sms=sms, graphs=not smoke, gen=gen)
    if not smoke:
        print(f"copy bandwidth {bench.copy_bandwidth(env):.0f} GB/s", flush=True)
    configs = (
        [c.split(",") for c in args.configs.split()]
        if args.configs
        else (
            [["orig", 16, 16, 4, 1], ["WT", 16, 16, 4, 1]]
            if smoke
            else [
                ["orig", 64, 64, 8, 2],
                ["W", 64, 64, 8, 2],
                ["G", 64, 32, 8, 4],
                ["G", 64, 32, 8, 3],
                ["G", 64, 64, 8, 2],
                ["G", 64, 16, 8, 6],
            ]
        )
    )
    for n in (1, *args.verify) if not smoke else (1, 3):
        batch = bench.make_batch(env, mixed, n, fp8=args.fp8)
        if smoke:
            batch.w_uk = batch.w_uk.float()
            batch.w_uv = batch.w_uv.float()
        ref = bench.reference_out(env, batch)
        rows_bytes = sum(mixed) * dims.width * 2
        flops = 2.0 * sum(mixed) * n * dims.heads * (2 * dims.rank + dims.rope)
        for kind, bm, bn, w, st, *extra in configs:
            bm, bn, w, st = int(bm), int(bn), int(w), int(st)
            extra = [int(x) for x in extra]
            groups = -(-n * dims.heads // bm)
            par = max(1, 4 * sms // groups)
            bufs = bench.planner_buffers(env, batch, par)
            order = md.longest_first(bufs)
            label = f"{kind} bm{bm} bn{bn} w{w} s{st} {extra} n{n} P{par}"
            try:
                if not smoke:
                    # Small ragged case, splits at 16-row granularity (unaligned to the tile).
                    small = bench.make_batch(env, [3000, 64, 700, 5, 33, 129], n, fp8=args.fp8)
                    sb = bench.SplitPlanBuffers.allocate(6, 64, device=dev)
                    bench.plan_decode_splits(
                        small.lens,
                        parallelism=40,
                        max_batch=6,
                        max_splits=64,
                        granularity=16,
                        out=sb,
                    )
                    e2 = bench.rel_err(
                        run(kind, small, env, sb, md.longest_first(sb), bm, bn, w, st, *extra),
                        bench.reference_out(env, small),
                    )
                    print(f"{label}: small ragged case err {e2:.1e}", flush=True)
                fn = functools.partial(run, kind, batch, env, bufs, order, bm, bn, w, st, *extra)
                err = bench.rel_err(fn(), ref)
                if smoke:
                    print(f"{label}: err {err:.1e}", flush=True)
                    continue
                ms = bench.timed(env, fn)
                print(
                    f"{label}: err {err:.1e}  {ms:.3f} ms  {rows_bytes / ms / 1e6:.0f} GB/s  "
                    f"{flops / ms / 1e9:.0f} TFLOP/s",
                    flush=True,
                )
            except Exception as exc:
                print(f"{label}: failed {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
