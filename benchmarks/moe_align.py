"""The MoE align launch (`align.py`) by pairs per program: the current partition vs the previous.

Claim (docs/perf/moe.md, bullet "The align kernel"): with BP = 4096 / E2 pairs per program (64 at 56
local experts) the launch is ~8.6x faster than with the previous BP = 32768 / E2 (512), whose
[BP, E2] tiles spill registers. Random top-16 routing over 896 experts, 56 of them local,
BLOCK_M 64, at 2048 and 16384 tokens; each BP's layout is checked against BP 512's (pair rows,
block experts, segment starts, block count). Times: CUDA graphs of 10 launches, median.

    python benchmarks/moe_align.py
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from tokenspeed.model.ops.moe import align

LOCAL, EXPERTS, TOP_K, BLOCK_M = 56, 896, 16, 64


def buffers(ids: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor]:
    """pair_row, row_pair, block_expert, expert_start, num_blocks (align_pairs' outputs)."""
    pairs = ids.numel()
    max_blocks = align.capacity_blocks(pairs, counts.shape[0], BLOCK_M)
    i32 = dict(dtype=torch.int32, device=ids.device)
    return [
        torch.empty(pairs, **i32),
        torch.empty(max_blocks * BLOCK_M, **i32),
        torch.empty(max_blocks, **i32),
        torch.empty(counts.shape[0], **i32),
        torch.empty(1, **i32),
    ]


def launch(ids, ranks, counts, bp: int, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """`align_pairs`' launch with BP = BB = bp pairs (blocks) per program."""
    flat = ids.reshape(-1)
    pairs, num_local = flat.shape[0], counts.shape[0]
    max_blocks = align.capacity_blocks(pairs, num_local, BLOCK_M)
    e2 = triton.next_power_of_2(num_local)
    grid = (max(triton.cdiv(pairs, bp), triton.cdiv(max_blocks, bp), 1),)
    align._align_kernel[grid](
        flat,
        ranks.reshape(-1),
        counts,
        *out,
        pairs,
        0,
        num_local,
        max_blocks,
        BLOCK_M=BLOCK_M,
        E2=e2,
        BP=bp,
        BB=bp,
        num_warps=4,
    )
    return out


def main() -> None:
    torch.manual_seed(0)
    e2 = triton.next_power_of_2(LOCAL)
    current, previous = max(16, min(1024, 4096 // e2)), max(16, min(1024, 32768 // e2))
    print(
        f"# align launch, {LOCAL} local experts of {EXPERTS}, top-{TOP_K}, BLOCK_M {BLOCK_M}; "
        f"{torch.cuda.get_device_name()}, triton {triton.__version__}"
    )
    print("\n| tokens | BP | us | same layout as BP 512 |\n|---|---|---|---|")
    ratios = {}
    for tokens in (2048, 16384):
        ids = torch.rand(tokens, EXPERTS, device="cuda").argsort(-1)[:, :TOP_K].int()
        counts, ranks = align.count_pairs(ids, 0, LOCAL)
        ref = [t.clone() for t in launch(ids, ranks, counts, 512, buffers(ids, counts))]
        times = {}
        for bp in (512, 256, 128, 64, 32):
            out = buffers(ids, counts)
            got = launch(ids, ranks, counts, bp, out)
            # row_pair is only defined on the rows in use: compared through pair_row instead.
            pairs = zip(got[:1] + got[2:], ref[:1] + ref[2:], strict=True)
            same = all(torch.equal(a, b) for a, b in pairs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    launch(ids, ranks, counts, bp, out)
            times[bp] = triton.testing.do_bench(graph.replay, warmup=5, rep=50) / 10 * 1e3
            print(f"| {tokens} | {bp} | {times[bp]:.1f} | {same} |", flush=True)
        ratios[tokens] = times[previous] / times[current]
    for tokens, r in ratios.items():
        print(f"{tokens} tokens: BP {current} (now) is {r:.1f}x BP {previous} (before)")


if __name__ == "__main__":
    main()
