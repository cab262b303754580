"""Probe: how fast can the Hopper tensor cores run the MMAs of the MLA decode split kernel, with
nothing else in the loop? (Not a benchmark of record: it bounds `benchmarks/mla_decode.py` (b).)

Every program keeps its operands resident in shared memory (or registers) and issues the same
asynchronous `warpgroup_mma` chain `iters` times; no global loads, no softmax, no barriers
beyond the MMA waits. One program per SM (grid = number of SMs x `--per-sm`). Cases:

- `mma` rows: one MMA shape, as "M x N x K, A from smem/regs, warps": each warpgroup computes
  an M x N/WN block, so `WN = 2` with N = 64 is the shipped kernel's Q K^T (two warpgroups side
  by side along the tile's 64 cache rows, each reading all of Q), N = 128 the warp-specialised
  form's (each warpgroup a whole tile, the same Q).
- `mix` rows: the MMAs of one 64-row cache tile as the kernels issue them:
  - `shipped`: Q K^T as two 64 x 32 halves, P to the PV operand layout (a shared-memory
    exchange, as in `gluon_decode`), P V over 2 x 256 latent columns;
  - `seesaw`: Q K^T of two tiles, one per warpgroup, P through shared memory, P V over both
    tiles (per tile: half of it);
  - `transposed`: cache rows on the MMA's M side for a 32-head block: S^T = C Q^T (N = 32), P^T
    through shared memory, O^T = C^T P^T as 8 blocks of 64 latent columns.
  The latent part only (K = 512; the 64-wide shared key adds 12.5% to Q K^T in every form).

For each row it prints TFLOPS (the MMAs' own flops, padded rows included) and, for the mixes,
the bandwidth ceiling that rate puts on the 96-head decode: cache bytes per tile over the time
the tile's MMAs take for all 96 heads (two 64-row programs, or one plus a transposed 32-head
block), as a fraction of the measured copy bandwidth.

    PYTHONPATH=src:benchmarks python3 scripts/mla_mma_ceiling.py [--iters 2000] [--smoke]

--smoke compiles every kernel for sm_90 without running it (no GPU needed).
"""

from __future__ import annotations

import argparse

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cuda_timing import time_eager

RANK = 512
BN = 64  # cache rows per tile
BM = 64  # query-head rows per program (the MMA's M)
TILE_N = gl.constexpr(BN)  # the same two, as the kernels see them
TILE_M = gl.constexpr(BM)


@gluon.jit
def _smem(src, R: gl.constexpr, C: gl.constexpr, LD: gl.constexpr):
    """[R, C] bf16 from global `src` (row-major) into NVMMA-swizzled shared memory."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, LD))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, LD))
    x = gl.load(src + r[:, None] * C + c[None, :])
    return gl.allocate_shared_memory(
        gl.bfloat16, [R, C], gl.NVMMASharedLayout.get_default_for([R, C], gl.bfloat16), x
    )


@gluon.jit
def _publish(s, buf):
    """Scores (scaled down, as probabilities would be) into shared buffer buf as bf16, visible
    to the next MMA."""
    buf.store((s * 1.0e-3).to(gl.bfloat16))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _mma_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    iters,
    M: gl.constexpr,
    N: gl.constexpr,
    K: gl.constexpr,
    WN: gl.constexpr,
    A_REGS: gl.constexpr,
    B_KMAJOR: gl.constexpr,
    GROUP: gl.constexpr,
    NW: gl.constexpr,
):
    """acc [M, N] += A [M, K] B [K, N], GROUP chained MMAs per wait. B_KMAJOR: B is stored
    [N, K] (a cache tile in Q K^T), else [K, N] (the same tile in P V)."""
    L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NW // WN, WN], instr_shape=[16, N // WN, 16]
    )
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    if B_KMAJOR:
        b_s = _smem(b_ptr, N, K, LD)
        b = b_s.permute((1, 0))
    else:
        b = _smem(b_ptr, K, N, LD)
    if A_REGS:
        r = gl.arange(0, M, layout=gl.SliceLayout(1, LD))
        c = gl.arange(0, K, layout=gl.SliceLayout(0, LD))
        a = gl.load(a_ptr + r[:, None] * K + c[None, :])
        a = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=L, k_width=2))
    else:
        a = _smem(a_ptr, M, K, LD)
    fence_async_shared()
    gl.thread_barrier()
    acc = gl.zeros([M, N], gl.float32, L)
    for _ in range(iters):
        for _g in gl.static_range(GROUP):
            acc = warpgroup_mma(a, b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    total = gl.sum(gl.sum(acc, 1), 0)
    gl.store(out_ptr + gl.program_id(0), total)


@gluon.jit
def _shipped_mix(q_ptr, c_ptr, out_ptr, iters, R: gl.constexpr):
    """Per iteration the MMAs of one tile in `gluon_decode` (8 warps): S = Q C^T as two
    64 x 32 halves, P (bf16) to the P V operand layout, O += P C over 2 x R/2 columns."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE_N // 2, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, R // 2, 16]
    )
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    q_s = _smem(q_ptr, TILE_M, R, LD)
    c_s = _smem(c_ptr, TILE_N, R, LD)
    fence_async_shared()
    gl.thread_barrier()
    zero = gl.zeros([TILE_M, TILE_N], gl.float32, S_L)
    acc = gl.zeros([TILE_M, R], gl.float32, O_L)
    s = warpgroup_mma(q_s, c_s.permute((1, 0)), zero, use_acc=False)
    p = gl.convert_layout((s * 1.0e-3).to(gl.bfloat16), P_OP)
    for _ in range(iters):
        # The kernel's order: P V of the previous tile and Q K^T of this one in flight together.
        acc = warpgroup_mma(p, c_s, acc, is_async=True)
        s = warpgroup_mma(q_s, c_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        acc, s = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s))
        p = gl.convert_layout((s * 1.0e-3).to(gl.bfloat16), P_OP)
    gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(acc, 1), 0))


@gluon.jit
def _seesaw_mix(q_ptr, c_ptr, out_ptr, iters, R: gl.constexpr):
    """Per iteration the MMAs of two tiles in the warp-specialised form, written SPMD (8 warps):
    S of tile w by warpgroup w over the whole tile ([64, 128] = two 64 x 64 blocks, the same Q),
    P of both tiles through shared memory, O += P [C0; C1] over 2 x R/2 columns."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, TILE_N, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, R // 2, 16]
    )
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    q_s = _smem(q_ptr, TILE_M, R, LD)
    c_s = _smem(c_ptr, 2 * TILE_N, R, LD)
    p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_M, 2 * TILE_N], gl.bfloat16)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [2, TILE_M, 2 * TILE_N], p_l)
    fence_async_shared()
    gl.thread_barrier()
    zero = gl.zeros([TILE_M, 2 * TILE_N], gl.float32, S_L)
    acc = gl.zeros([TILE_M, R], gl.float32, O_L)
    s = warpgroup_mma(q_s, c_s.permute((1, 0)), zero, use_acc=False)
    _publish(s, p_s.index(0))
    for i in range(iters):
        # P V of the previous pair of tiles and Q K^T of the next pair in flight together.
        acc = warpgroup_mma(p_s.index(i % 2), c_s, acc, is_async=True)
        s = warpgroup_mma(q_s, c_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        acc, s = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s))
        _publish(s, p_s.index((i + 1) % 2))
    gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(acc, 1), 0))


@gluon.jit
def _transposed_mix(q_ptr, c_ptr, out_ptr, iters, R: gl.constexpr, HB: gl.constexpr):
    """Per iteration the MMAs of one tile for an HB-head block with cache rows as M (4 warps):
    S^T = C Q^T [64, HB], P^T through shared memory, O^T += C^T P^T as R/64 blocks of
    [64, HB] (one accumulator: the same MMA work and issue order)."""
    L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HB, 16]
    )
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_s = _smem(q_ptr, HB, R, LD)
    c_s = _smem(c_ptr, TILE_N, R, LD)
    p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, HB], gl.bfloat16)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [2, TILE_N, HB], p_l)
    fence_async_shared()
    gl.thread_barrier()
    zero = gl.zeros([TILE_N, HB], gl.float32, L)
    acc = gl.zeros([64, HB], gl.float32, L)
    s = warpgroup_mma(c_s, q_s.permute((1, 0)), zero, use_acc=False)
    _publish(s, p_s.index(0))
    for i in range(iters):
        # O^T of the previous tile and S^T of the next in flight together.
        p_prev = p_s.index(i % 2)
        for j in gl.static_range(R // 64):
            c_t = c_s.slice(j * 64, 64, dim=1).permute((1, 0))
            acc = warpgroup_mma(c_t, p_prev, acc, is_async=True)
        s = warpgroup_mma(c_s, q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        acc, s = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s))
        _publish(s, p_s.index((i + 1) % 2))
    gl.store(out_ptr + gl.program_id(0), gl.sum(gl.sum(acc, 1), 0))


# (label, M, N, K, WN, A in registers, B stored K-major, MMAs per wait, warps)
MMA_CASES = [
    ("Q K^T as shipped: 2 warpgroups x [64, 32], same Q", 64, 64, RANK, 2, False, True, 1, 8),
    ("Q K^T, one warpgroup x [64, 64]", 64, 64, RANK, 1, False, True, 1, 4),
    (
        "Q K^T warp-specialised: 2 warpgroups x [64, 64], same Q",
        64,
        128,
        RANK,
        2,
        False,
        True,
        1,
        8,
    ),
    ("P V as shipped: 2 warpgroups x [64, 256], P in regs", 64, 512, 64, 2, True, False, 8, 8),
    ("P V, P in smem: 2 warpgroups x [64, 256]", 64, 512, 64, 2, False, False, 8, 8),
    ("S^T = C Q^T: one warpgroup x [64, 32]", 64, 32, RANK, 1, False, True, 1, 4),
    ("S^T = C Q^T, 2 warpgroups x [64, 32] (two tiles)", 128, 32, RANK, 1, False, True, 1, 8),
    ("O^T block, B = P^T: one warpgroup x [64, 32], K 64", 64, 32, 64, 1, False, False, 8, 4),
]


def flops_mma(m, n, k, group) -> float:
    return 2.0 * m * n * k * group


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--smoke", action="store_true", help="compile only (sm_90, no GPU)")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, device=dev, generator=gen) * 0.05).to(torch.bfloat16)

    out = torch.empty(sms, device=dev, dtype=torch.float32)
    copy_bw = copy_bandwidth(dev)
    print(f"device {torch.cuda.get_device_name(dev)}, {sms} SMs; copy bandwidth {copy_bw:.0f} GB/s")
    print(f"iters {args.iters}; one program per SM\n")
    print("| MMA | TFLOPS |\n|---|---|")
    for label, m, n, k, wn, a_regs, b_kmajor, group, nw in MMA_CASES:
        a, b = rnd(m, k), rnd(n, k)

        def launch(a=a, b=b, m=m, n=n, k=k, wn=wn, a_regs=a_regs, kmaj=b_kmajor, g=group, nw=nw):
            _mma_kernel[(sms,)](
                a, b, out, args.iters, M=m, N=n, K=k, WN=wn, A_REGS=a_regs, B_KMAJOR=kmaj,
                GROUP=g, NW=nw, num_warps=nw,
            )  # fmt: skip

        us = timed(launch)
        tflops = sms * args.iters * flops_mma(m, n, k, group) / us / 1e6
        print(f"| {label} | {tflops:.0f} |", flush=True)

    # Mixes: per iteration, the MMAs of `tiles` cache tiles for a `heads`-row block.
    q, c2 = rnd(BM, RANK), rnd(2 * BN, RANK)
    mixes = [
        ("shipped (64 padded rows per program)", 1, 64, lambda: _shipped_mix[(sms,)](
            q, c2, out, args.iters, R=RANK, num_warps=8)),
        ("seesaw (64 padded rows per program)", 2, 64, lambda: _seesaw_mix[(sms,)](
            q, c2, out, args.iters, R=RANK, num_warps=8)),
        ("transposed, 32-head block", 1, 32, lambda: _transposed_mix[(sms,)](
            q, c2, out, args.iters, R=RANK, HB=32, num_warps=4)),
    ]  # fmt: skip
    tile_bytes = BN * (RANK + 64) * 2
    print(
        "\n| mix | us per tile per SM | TFLOPS (MMA rows) | 96-head ceiling, % of copy |\n"
        "|---|---|---|---|"
    )
    per_tile = {}
    for label, tiles, rows, fn in mixes:
        us = timed(fn)
        t_tile = us / (args.iters * tiles)  # us per tile on one SM
        per_tile[label.split()[0]] = t_tile
        tflops = sms * args.iters * tiles * 2.0 * rows * BN * 2 * RANK / us / 1e6
        if rows == 64:  # 96 heads = two 64-row programs per tile
            ceiling = tile_bytes * sms / (2 * t_tile) / 1e3
            print(
                f"| {label} | {t_tile:.3f} | {tflops:.0f} | {100 * ceiling / copy_bw:.0f}% |",
                flush=True,
            )
        else:
            print(f"| {label} | {t_tile:.3f} | {tflops:.0f} | see below |", flush=True)
    for main_form in ("shipped", "seesaw"):
        t = per_tile[main_form] + per_tile["transposed,"]
        ceiling = tile_bytes * sms / t / 1e3
        print(
            f"\n{main_form} 64-head program + transposed 32-head block: {t:.3f} us per tile, "
            f"ceiling {100 * ceiling / copy_bw:.0f}% of copy"
        )
    return 0


def timed(fn) -> float:
    """us per launch (median of 3, after a warm-up that compiles)."""
    return time_eager(fn, iters=1)


def copy_bandwidth(dev) -> float:
    """GB/s of a 1 GiB device-to-device copy, read + write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src)) / 1e3


def smoke() -> int:
    """Compile every kernel for sm_90 (no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    target = GPUTarget("cuda", 90, 32)
    ptrs = {"a_ptr": "*bf16", "b_ptr": "*bf16", "q_ptr": "*bf16", "c_ptr": "*bf16",
            "out_ptr": "*fp32", "iters": "i32"}  # fmt: skip

    def compile_(fn, consts, warps):
        sig = {n: ptrs[n] for n in fn.arg_names if n in ptrs}
        sig.update({n: "constexpr" for n in consts})
        src = GluonASTSource(fn=fn, signature=sig, constexprs=consts)
        k = triton.compile(src, target=target, options={"num_warps": warps})
        print(f"{fn.__name__} {consts}: {k.metadata.shared} B shared")

    for _label, m, n, k, wn, a_regs, b_kmajor, group, nw in MMA_CASES:
        consts = dict(M=m, N=n, K=k, WN=wn, A_REGS=a_regs, B_KMAJOR=b_kmajor, GROUP=group, NW=nw)
        compile_(_mma_kernel, consts, nw)
    compile_(_shipped_mix, dict(R=RANK), 8)
    compile_(_seesaw_mix, dict(R=RANK), 8)
    compile_(_transposed_mix, dict(R=RANK, HB=32), 4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
