"""Registers, spills, shared memory and block-wide barriers of the Gluon MLA split kernels for
sm_90a, read off an offline compile on a machine without a GPU (no device time needed).

The kernels are written against the GPU machine's Triton (3.6; newer releases renamed Gluon's
TMA calls), so put that release first on the path:

    pip download triton==3.6.0 --no-deps -d /tmp/t36 && unzip -q -d /tmp/t36/site /tmp/t36/*.whl
    chmod +x /tmp/t36/site/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/t36/site:src:scripts python scripts/gluon_resources.py [--chunks 512 128 64]

For each kernel and TMA chunk width it prints
ptxas's registers and spill stores, the shared memory, the `bar.sync` count of the whole kernel
and of its longest loop (the bf16 tile loop), and that loop's event sequence: TMA waits and
copies, barrier expects, MMAs, block-wide barriers. Counts, not times: a barrier costs little
when every warp reaches it together.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from kernel_resources import MLA_SPLIT_POINTERS
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from tokenspeed.model.ops.mla import gluon_decode, gluon_transposed

K3 = dict(RANK=512, ROPE=64, PAGE_SIZE=64, UNIFORM=False, GRANULE=64, STAGES=2)
STRIDES = ("stride_lt", "stride_lh", "stride_rt", "stride_rh", "stride_page", "stride_table")
EVENTS = (
    ("bar.sync", "BAR"),
    ("mbarrier.try_wait", "WAIT"),
    ("arrive.expect_tx", "EXP"),
    ("cp.async.bulk.tensor", "TMA"),
    ("wgmma.mma_async", "MMA"),
    ("wgmma.wait_group", "MMAWAIT"),
    ("fence.proxy.async", "FENCE"),
)


def compile_kernel(kernel, consts: dict, fp8: bool, chunk: int, num_warps: int):
    """(ptx, shared bytes) of one offline compile."""
    cache, elem = ("fp8e4nv", gl.float8e4nv) if fp8 else ("bf16", gl.bfloat16)
    block_n = gluon_decode.BLOCK_N_FP8 if fp8 else gluon_decode.BLOCK_N

    def desc(cols):
        layout = gl.NVMMASharedLayout.get_default_for([block_n, cols], elem)
        return f"tensordesc<{cache}[{block_n}, {cols}],{layout!r}>"

    sig = {name: "i32" for name in kernel.arg_names}
    sig |= MLA_SPLIT_POINTERS | {
        "pages": f"*{cache}",
        "desc_c": desc(chunk),
        "desc_r": desc(K3["ROPE"]),
    }
    for name in consts:
        sig[name] = "constexpr"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if sig[name].startswith("*") or name in STRIDES
    }
    out = triton.compile(
        GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    return out.asm["ptx"], out.metadata.shared


def ptxas_usage(ptx: str, workdir: Path) -> tuple[int, int]:
    """(registers, spill store bytes) as ptxas -v reports them."""
    path = workdir / "kernel.ptx"
    path.write_text(ptx)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    report = subprocess.run(
        [str(ptxas), "-arch=sm_90a", "-v", str(path), "-o", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return regs, spill


def longest_loop(ptx: str) -> list[str]:
    """The PTX lines of the longest block that a backward branch closes."""
    lines = ptx.split(".section\t.debug")[0].splitlines()
    labels = {}
    best: list[str] = []
    for i, line in enumerate(lines):
        label = re.match(r"^(\$L__BB\d+_\d+):", line.strip())
        if label:
            labels[label.group(1)] = i
        branch = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if branch and labels.get(branch.group(1), i) < i:
            start = labels[branch.group(1)]
            if i - start > len(best):
                best = lines[start : i + 1]
    return best


def events(lines: list[str]) -> str:
    """The loop's events in order, repeats folded (BAR x2)."""
    seq = []
    for line in lines:
        for pattern, name in EVENTS:
            if pattern in line:
                if seq and seq[-1][0] == name:
                    seq[-1][1] += 1
                else:
                    seq.append([name, 1])
                break
    return " ".join(name if n == 1 else f"{name}x{n}" for name, n in seq)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, nargs="+", default=[512])
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--verbose", action="store_true", help="print each loop's events")
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90a, {args.heads} heads, one query")
    print(
        "| kernel | cache | chunk | e4m3 cols per pass | regs | spill B | smem B "
        "| bar.sync | bar.sync in the loop |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    workdir = Path(tempfile.mkdtemp())
    shape = dict(K3, NUM_HEADS=args.heads, N_QUERY=1)
    cases = [("split", "bf16", chunk, "") for chunk in args.chunks]
    cases += [("split", "e4m3", 512, cols) for cols in (128, 512)]
    cases += [("transposed", "bf16", 512, "")]
    for kind, cache, chunk, cols in cases:
        fp8 = cache == "e4m3"
        consts = dict(shape, SCALE_MODE=2 if fp8 else 0)
        if kind == "split":  # constexpr of the e4m3 path (unused with a bf16 cache)
            consts["CONVERT_COLS"] = cols or 512
        if kind == "split":
            kernel, warps = gluon_decode._split_kernel_gluon, 8
        else:
            kernel, warps = gluon_transposed._split_kernel_transposed, 4
            consts["ROW0"] = 0
            consts["NUM_HEADS"] = 32
        ptx, smem = compile_kernel(kernel, consts, fp8, chunk, warps)
        regs, spill = ptxas_usage(ptx, workdir)
        loop = longest_loop(ptx)
        in_loop = sum("bar.sync" in line for line in loop)
        print(
            f"| {kind} | {cache} | {chunk} | {cols} | {regs} | {spill} | {smem} "
            f"| {ptx.count('bar.sync')} | {in_loop} |",
            flush=True,
        )
        if args.verbose:
            print(f"    loop: {events(loop)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
