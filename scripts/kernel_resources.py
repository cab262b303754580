"""Registers, spills, shared memory and software pipelining of our Triton kernels for sm_90a,
read off an offline compile on a machine without a GPU (no device time needed).

    python scripts/kernel_resources.py                 # every preset below
    python scripts/kernel_resources.py moe kda         # presets whose name starts with these

`triton.compile` targets `GPUTarget("cuda", 90, 32)` and Triton's bundled `ptxas-blackwell
-arch=sm_90a -v` reports the registers and spill stores. Integer arguments the JIT would
specialise as multiples of 16 (pointers, strides, widths) are marked so, as at run time;
without that the pipeliner cannot use async copies and the numbers mean nothing. The Triton
here (3.9) is newer than the GPU machine's (3.6): treat the figures as a guide, and time on the
GPU before changing a default. "programs/SM" is the occupancy bound from registers, warps and
shared memory.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"


def usage(
    fn, sig: dict, consts: dict, num_warps: int, num_stages: int, div16=(), maxnreg=None
) -> str:
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig.get(name, "").startswith("*") or name in div16
    }
    out = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg},
    )
    ptx = Path("/tmp") / f"kernel_resources_{fn.__name__}.ptx"
    ptx.write_text(out.asm["ptx"])
    res = subprocess.run(
        [str(PTXAS), "-arch=sm_90a", "-v", str(ptx), "-o", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    )
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", res.stderr).group(1))
    smem = out.metadata.shared
    per_sm = min(
        2048 // (32 * num_warps), 65536 // (regs * 32 * num_warps), 228 * 1024 // max(smem, 1)
    )
    ir = out.asm["ttgir"]
    shapes = " ".join(sorted(set(re.findall(r"instrShape = (\[[0-9, ]+\])", ir))))
    return (
        f"regs {regs:3d}  spill {spill:5d} B  smem {smem // 1024:3d} KiB  programs/SM {per_sm}  "
        f"async copies {ir.count('async_copy_global_to_local'):2d}  "
        f"wgmma {ir.count('warp_group_dot')}  mma {shapes or '-'}"
    )


# The MLA split kernels' pointer and float arguments but the page pool's (bf16 queries); the
# Gluon kernels' resources (scripts/gluon_resources.py) take the same.
MLA_SPLIT_POINTERS = {
    "q_lat": "*bf16",
    "q_rope": "*bf16",
    "row_scales": "*fp32",
    "page_table": "*i32",
    "context_lens": "*i32",
    "split_order": "*i32",
    "split_row": "*i32",
    "split_start": "*i32",
    "split_len": "*i32",
    "part_o": "*fp32",
    "part_lse": "*fp32",
    "qk_scale": "fp32",
}


def _signature(fn, pointers: dict[str, str], constexprs: tuple[str, ...]) -> dict[str, str]:
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(pointers)
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def _moe() -> list[tuple[str, Callable[[], str]]]:
    from tokenspeed.model.ops.moe import grouped_gemm as gg

    div = (
        "L",
        "inter",
        "stride_xt",
        "stride_we",
        "stride_wn",
        "stride_ht",
        "stride_yt",
        "stride_se",
    )
    presets = []
    # (kernel, format, BM, BN, BK, warps, stages, register cap): the defaults of grouped.py's
    # table and alternatives of benchmarks/moe.py --sweep.
    for kernel, fmt, bm, bn, bk, warps, stages, cap in (
        ("gate_up", "bf16", 16, 64, 128, 4, 4, None),
        ("gate_up", "bf16", 64, 128, 64, 8, 3, None),
        ("gate_up", "bf16", 128, 64, 64, 8, 4, None),
        ("down", "bf16", 128, 256, 64, 8, 4, None),
        ("gate_up", "fp8", 16, 128, 128, 4, 3, None),
        ("gate_up", "fp8", 64, 128, 128, 8, 4, None),
        ("gate_up", "fp8", 64, 128, 128, 8, 2, 128),
        ("gate_up", "fp8", 64, 64, 128, 4, 3, None),
        ("gate_up", "fp8", 64, 64, 128, 4, 3, 168),
        ("gate_up", "fp8", 128, 64, 128, 8, 3, None),
        ("down", "fp8", 64, 256, 128, 8, 4, None),
        ("down", "fp8", 64, 128, 128, 4, 3, None),
        ("down", "fp8", 64, 128, 128, 4, 3, 168),
        ("down", "fp8", 64, 256, 128, 8, 2, 128),
    ):
        dt = "*fp8e4nv" if fmt == "fp8" else "*bf16"
        wfmt = gg.FP8 if fmt == "fp8" else gg.DENSE
        tag = f"{fmt} BM {bm} BN {bn} BK {bk} w{warps} s{stages}" + (f" cap {cap}" if cap else "")
        if kernel == "gate_up":
            fn = gg._gate_up_kernel
            sig = _signature(
                fn,
                {
                    "x_ptr": dt,
                    "xs_ptr": "*fp32",
                    "w1_ptr": dt,
                    "w3_ptr": dt,
                    "s1_ptr": "*fp32",
                    "s3_ptr": "*fp32",
                    "h_ptr": dt,
                    "hs_ptr": "*fp32",
                    "row_pair_ptr": "*i32",
                    "block_expert_ptr": "*i32",
                    "expert_start_ptr": "*i32",
                    "counts_ptr": "*i32",
                    "num_blocks_ptr": "*i32",
                    "beta": "fp32",
                    "linear_beta": "fp32",
                },
                (
                    "WFMT",
                    "ACT",
                    "CAP_UP",
                    "OUT_FP8",
                    "ROUND",
                    "EXACT",
                    "INTERPRET",
                    "BM",
                    "BN",
                    "BK",
                ),
            )
            consts = dict(
                WFMT=wfmt,
                ACT=gg.SITU,
                CAP_UP=True,
                OUT_FP8=fmt == "fp8",
                ROUND=tl.bfloat16,
                EXACT=True,
                INTERPRET=False,
                BM=bm,
                BN=bn,
                BK=bk,
            )
        else:
            fn = gg._down_kernel
            sig = _signature(
                fn,
                {
                    "h_ptr": dt,
                    "hs_ptr": "*fp32",
                    "w2_ptr": dt,
                    "s2_ptr": "*fp32",
                    "y_ptr": "*bf16",
                    "block_expert_ptr": "*i32",
                    "expert_start_ptr": "*i32",
                    "counts_ptr": "*i32",
                    "num_blocks_ptr": "*i32",
                },
                ("WFMT", "BM", "BN", "BK"),
            )
            consts = dict(WFMT=wfmt, BM=bm, BN=bn, BK=bk)
        presets.append(
            (
                f"moe {kernel:7s} {tag}",
                lambda fn=fn, s=sig, c=consts, w=warps, st=stages, cap=cap: usage(
                    fn, s, c, w, st, div, cap
                ),
            )
        )
    return presets


def _kda() -> list[tuple[str, Callable[[], str]]]:
    from tokenspeed.model.ops.kda import decode as kd
    from tokenspeed.model.ops.kda import decode_kernels

    k = decode_kernels._kda_recurrent_kernel
    sig = _signature(
        k,
        {
            "qkv_ptr": "*bf16",
            "conv_w_ptr": "*bf16",
            "conv_state_ptr": "*bf16",
            "scratch_ptr": "*fp32",
            "ready_ptr": "*i32",
            "state_ptr": "*fp32",
            "slots_ptr": "*i32",
            "out_ptr": "*bf16",
            "step_state_ptr": "*fp32",
            "step_conv_ptr": "*bf16",
        },
        (
            "H",
            "K",
            "V",
            "T",
            "W",
            "WP",
            "D",
            "BV",
            "OVERLAP",
            "V_IN_PREP",
            "VOFF",
            "STORE_STEPS",
            "USE_PDL",
            "EVICT_LOAD",
            "EVICT_STORE",
        ),
    )
    presets = []
    for tokens in (1, 4):
        for bv, warps in ((32, 4), (64, 4), (64, 8)):
            v_in_prep = kd.resolve_v_in_prep(None, tokens)  # as kda_decode runs it
            consts = dict(
                H=96,
                K=128,
                V=128,
                T=tokens,
                W=4,
                WP=8,
                D=kd.scratch_width(128, 128 if v_in_prep else None),
                BV=bv,
                OVERLAP=tokens == 1,
                V_IN_PREP=v_in_prep,
                VOFF=kd.scratch_width(128),
                STORE_STEPS=False,
                USE_PDL=True,
                EVICT_LOAD=kd.STATE_EVICTION[0],
                EVICT_STORE=kd.STATE_EVICTION[1],
            )
            presets.append(
                (
                    f"kda recurrence K3 T {tokens} BV {bv} w{warps}",
                    lambda c=consts, w=warps: usage(
                        k, sig, c, w, 1, ("stride_qkv_b", "stride_qkv_t")
                    ),
                )
            )
    return presets


def _attn_res() -> list[tuple[str, Callable[[], str]]]:
    from tokenspeed.model.ops.attn_res import fused

    k = fused._mix_norm_kernel
    sig = _signature(
        k,
        {name: "*bf16" for name in k.arg_names if name.endswith("_ptr")}
        | {"mix_eps": "fp32", "norm_eps": "fp32"},
        ("D", "N", "HAS_DELTA", "ACCUMULATE", "BD", "BL", "STAGES", "ONE_REDUCE", "EVICT_BANK"),
    )
    presets = []
    for n, bl, warps, stages in (
        (8, 1, 4, 0),
        (8, 1, 4, 4),
        (8, 0, 8, 0),
        (8, 2, 8, 0),
        (4, 1, 4, 3),
        (2, 0, 8, 0),
        (2, 2, 8, 0),
        (1, 0, 16, 0),
    ):
        consts = dict(
            D=7168,
            N=n,
            HAS_DELTA=True,
            ACCUMULATE=True,
            BD=8192,
            BL=bl,
            STAGES=stages,
            ONE_REDUCE=True,
            EVICT_BANK=fused.BANK_EVICTION,
        )
        presets.append(
            (
                f"attn_res K3 N {n} block_entries {bl} w{warps} stages {stages}",
                lambda c=consts, w=warps, st=stages: usage(
                    k, sig, c, w, max(st, 1), ("stride_bn", "stride_bt", "stride_dt", "stride_ot")
                ),
            )
        )
    return presets


def _mla() -> list[tuple[str, Callable[[], str]]]:
    from tokenspeed.model.ops.mla import decode as md

    k = md._split_kernel
    sig = _signature(
        k,
        MLA_SPLIT_POINTERS | {"pages": "*bf16"},
        (
            "NUM_HEADS",
            "N_QUERY",
            "RANK",
            "ROPE",
            "PAGE_SIZE",
            "SCALE_MODE",
            "UNIFORM",
            "GRANULE",
            "BLOCK_M",
            "BLOCK_N",
            "USE_PDL",
        ),
    )
    div = ("stride_lt", "stride_lh", "stride_rt", "stride_rh", "stride_page", "stride_table")
    presets = []
    for heads, bm, bn, warps, stages in (
        (96, 64, 64, 8, 2),
        (96, 64, 32, 8, 2),
        (96, 64, 64, 8, 3),
        (32, 64, 64, 8, 2),
    ):
        consts = dict(
            NUM_HEADS=heads,
            N_QUERY=1,
            RANK=512,
            ROPE=64,
            PAGE_SIZE=64,
            SCALE_MODE=0,
            UNIFORM=False,
            GRANULE=64,
            BLOCK_M=bm,
            BLOCK_N=bn,
            USE_PDL=True,
        )
        presets.append(
            (
                f"mla split {heads} heads BM {bm} BN {bn} w{warps} s{stages}",
                lambda c=consts, w=warps, st=stages: usage(k, sig, c, w, st, div),
            )
        )
    return presets


def main(argv: list[str]) -> int:
    presets = _moe() + _kda() + _attn_res() + _mla()
    chosen = [(name, fn) for name, fn in presets if not argv or name.startswith(tuple(argv))]
    if not chosen:
        print(f"no preset starts with {argv}; presets: {[n for n, _ in presets]}")
        return 2
    for name, fn in chosen:
        print(f"{name:45s} {fn()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
