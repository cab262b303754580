"""AttnRes mix + RMSNorm at K3's hidden size: our fused kernel vs fla-core and torch.

Claim (issue 8): our fused mix+norm >= 1.0x fla-core's `fused_attnres` (with its fused
output RMSNorm) at hidden 7168, 1-8 bank entries, 1-16k tokens.

Rows: entries N (completed blocks + the partial), tokens T. Columns (us, median of
triton.testing.do_bench with L2 flushed, eager; "graph": per call in a CUDA graph of 20
back-to-back calls, fla at the fastest of all its autotuner's configs):
- torch: `mix_norm_reference` (the unfused references);
- fla: `fla.ops.attnres.fused_attnres(q, bank list, w, output_rms_weight=norm_w)`;
- ours: `attn_res_mix_norm` on the same bank (no update);
- fla + add / ours + update: with the partial-sum update (partial += delta) that precedes
  each mix in the decoder: torch add then fla, vs our single pass;
- GB/s of ours: bytes read + written / time, against a device copy measured in the run.

fla autotunes its kernel on the first call, keyed on the hidden size and a padded entry count
(8 for every bank here), not on the tokens or the real entry count. So a config tuned once would
serve every row (the runs of 2026-12-01 tuned it at 4096 tokens x 8 entries and kept it). The
tuned config is dropped before each row instead, so that fla tunes at that row's shape and is
timed at its best there, as the KDA benchmark does for fla's conv update (`--tune-once`: the
old behaviour).
Correctness is checked before timing (exit 1 on a mismatch).

    python benchmarks/attn_res.py --out /tmp/attn_res.md
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton
import triton.testing

from fla_tuning import autotuner, fastest
from tokenspeed.model.ops.attn_res.fused import (
    AttnResTuning,
    attn_res_mix_norm,
    mix_norm_reference,
)

HIDDEN = 7168
EPS = 1e-6
DEVICE, DTYPE = "cuda", torch.bfloat16


GRAPH_CALLS = 20  # calls per captured graph: decode replays one graph of many kernels


def bench(fn, graph: bool = False) -> float | None:
    """Median ms of fn, eagerly or per call in a CUDA graph of GRAPH_CALLS back-to-back calls
    (None if it cannot be captured). One graph of one call would time mostly the graph launch
    (~8 us on the H200), the same for every kernel; in a decode step's graph it is paid once
    for hundreds of kernels."""
    if not graph:
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    try:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(GRAPH_CALLS):
                fn()
    except Exception as exc:
        print(f"graph capture failed: {exc}", file=sys.stderr)
        torch.cuda.synchronize()
        return None
    ms = triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median")
    del g
    return ms / GRAPH_CALLS


def fmt_us(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms * 1e3:.1f}"


# (block_entries, num_warps, stages) alternatives of `attn_res_mix_norm` for --sweep (0: the
# unrolled form; >= 1: the entry loop with that many entries per load, the next tile prefetched
# in registers (stages 0) or by Triton's pipeliner through shared memory (stages >= 2); the
# default is `default_launch`).
SWEEP = [(bl, w, 0) for bl in (0, 1, 2, 4, 8) for w in (4, 8, 16)] + [
    (bl, w, st) for bl in (1, 2) for w in (4, 8, 16) for st in (2, 3, 4)
]


def fla_tuner():
    """The autotuner of fla's AttnRes forward kernel."""
    from fla.ops.attnres import fused as fla_fused

    return autotuner(fla_fused.attnres_fwd_kernel)


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", default="1,2,4,8")
    parser.add_argument("--tokens", default="1,16,256,4096,16384")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time ours at every (block_entries, warps) of SWEEP and report the best",
    )
    parser.add_argument(
        "--tune-once",
        action="store_true",
        help="tune fla once at 4096 tokens x 8 entries and keep that config for every row",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    from fla.ops.attnres import fused_attnres

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    entries_list = [int(n) for n in args.entries.split(",")]
    tokens_list = [int(t) for t in args.tokens.split(",")]
    max_n, max_t = max(max(entries_list), 8), max(max(tokens_list), 4096)
    buf = torch.randn(max_n, max_t, HIDDEN, device=DEVICE, generator=gen).to(DTYPE)
    delta_buf = torch.randn(max_t, HIDDEN, device=DEVICE, generator=gen).to(DTYPE)
    query = (torch.randn(HIDDEN, device=DEVICE, generator=gen) * HIDDEN**-0.5).to(DTYPE)
    mix_w = (torch.rand(HIDDEN, device=DEVICE, generator=gen) + 0.5).to(DTYPE)
    norm_w = (torch.rand(HIDDEN, device=DEVICE, generator=gen) + 0.5).to(DTYPE)

    copy_src = torch.empty(1 << 29, dtype=torch.uint8, device=DEVICE)
    copy_dst = torch.empty_like(copy_src)
    copy_gbs = 2 * copy_src.numel() / bench(lambda: copy_dst.copy_(copy_src)) / 1e6

    fused_attnres(query, list(buf[:8, :4096].unbind(0)), mix_w, norm_w, EPS)  # fla autotune
    fla_picks = []

    props = torch.cuda.get_device_properties(0)
    lines = [
        f"# AttnRes mix + norm ({datetime.date.today()}, {props.name}, torch "
        f"{torch.__version__}, triton {triton.__version__}), hidden {HIDDEN}, {DTYPE}",
        "",
        f"Device copy: {copy_gbs:.0f} GB/s (read + write). Times in us.",
        "",
        "| entries | tokens | torch | fla | ours | ours vs fla | fla graph | ours graph | "
        "graph ours vs fla | fla + add | ours + update | update ours vs fla | ours GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    sweep_lines = [
        "",
        "Sweep of ours (graph, as the graph columns): the best (block_entries, warps, stages) "
        "per row",
        "",
        "| entries | tokens | default us | best block_entries | best warps | best stages | "
        "best us | best vs default | best vs fla |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in entries_list:
        for t in tokens_list:
            bank = buf[:n, :t]
            entries = list(bank.unbind(0))
            delta = delta_buf[:t]
            if not args.tune_once:
                fla_tuner().cache.clear()  # the fla call below tunes at this shape
            # correctness first
            want, _ = mix_norm_reference(bank, query, mix_w, EPS, norm_w, EPS)
            got = attn_res_mix_norm(bank, query, mix_w, EPS, norm_w, EPS)
            fla_out = fused_attnres(query, entries, mix_w, norm_w, EPS)
            try:
                torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)
                torch.testing.assert_close(got, fla_out, atol=3e-2, rtol=3e-2)
            except AssertionError as exc:
                print(f"CHECK FAILED (entries {n}, tokens {t}): {exc}", file=sys.stderr)
                return 1
            scratch = bank.clone()

            def torch_fn(bank=bank):
                return mix_norm_reference(bank, query, mix_w, EPS, norm_w, EPS)

            def fla_fn(entries=entries):
                return fused_attnres(query, entries, mix_w, norm_w, EPS)

            def ours_fn(bank=bank, warps=None, block_entries=None, stages=None):
                return attn_res_mix_norm(
                    bank,
                    query,
                    mix_w,
                    EPS,
                    norm_w,
                    EPS,
                    tuning=AttnResTuning(
                        num_warps=warps, block_entries=block_entries, stages=stages
                    ),
                )

            def fla_update(scratch=scratch, delta=delta):
                scratch[-1].add_(delta)
                return fused_attnres(query, list(scratch.unbind(0)), mix_w, norm_w, EPS)

            def ours_update(scratch=scratch, delta=delta):
                return attn_res_mix_norm(scratch, query, mix_w, EPS, norm_w, EPS, delta=delta)

            picked = "; ".join(str(c) for c in fla_tuner().cache.values())
            fla_picks.append(f"{n} entries x {t} tokens: {picked}")
            t_torch, t_fla, t_ours = bench(torch_fn), bench(fla_fn), bench(ours_fn)
            # fla in graphs at its fastest config for this row (every config of its autotuner
            # timed; the autotuner's own pick varies from run to run).
            g_fla, g_cfg = fastest(fla_tuner(), lambda fla_fn=fla_fn: bench(fla_fn, True))
            fla_picks[-1] += f" (graph: fastest {g_cfg})"
            g_ours = bench(ours_fn, True)
            if args.sweep:  # the default's time stays in the table; the sweep is reported apart
                timed = {}
                for bl, w, st in SWEEP:
                    if bl and bl > triton.next_power_of_2(n):
                        continue  # one tile holds every entry already
                    torch.testing.assert_close(
                        ours_fn(warps=w, block_entries=bl, stages=st), got, atol=1.6e-2, rtol=1.6e-2
                    )
                    timed[(bl, w, st)] = bench(
                        lambda bl=bl, w=w, st=st: ours_fn(warps=w, block_entries=bl, stages=st),
                        True,
                    )
                (bl, w, st), best = min(timed.items(), key=lambda kv: kv[1])
                sweep_lines.append(
                    f"| {n} | {t} | {fmt_us(g_ours)} | {bl} | {w} | {st} | {fmt_us(best)} | "
                    f"{ratio(g_ours, best)} | {ratio(g_fla, best)} |"
                )
            t_fla_u, t_ours_u = bench(fla_update), bench(ours_update)
            gbs = (n + 1) * t * HIDDEN * 2 / t_ours / 1e6
            lines.append(
                f"| {n} | {t} | {fmt_us(t_torch)} | {fmt_us(t_fla)} | {fmt_us(t_ours)} | "
                f"{ratio(t_fla, t_ours)} | {fmt_us(g_fla)} | {fmt_us(g_ours)} | "
                f"{ratio(g_fla, g_ours)} | {fmt_us(t_fla_u)} | {fmt_us(t_ours_u)} | "
                f"{ratio(t_fla_u, t_ours_u)} | {gbs:.0f} |"
            )
            print(lines[-1], flush=True)
    # What fla's autotuner picked for each row: the configurations ours is compared with.
    lines += ["", "fla's autotuned forward config per row:", ""]
    lines += [f"- {pick}" for pick in fla_picks]
    print("\n".join(lines[-len(fla_picks) - 1 :]), flush=True)
    if args.sweep:
        lines += sweep_lines
        print("\n".join(sweep_lines), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
