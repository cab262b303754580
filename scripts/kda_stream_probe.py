"""Probe: how fast can the KDA decode state stream at K3 dims, and does a persistent,
software-pipelined recurrence get closer to it than the split variant's grid of short programs?

Times (CUDA graph, L2 flushed before each replay, as benchmarks/kda_decode.py does), per request
count:
- `rmw grid`: the floor for this access pattern: each (row, head, V block) tile read through its
  slot, scaled, written back; one program per tile (the split recurrence's grid and tile);
- `rmw persistent`: the same tiles walked by a fixed grid, `tl.range(..., num_stages=NS)`, so that
  Triton may keep the next tiles' loads in flight while the current one is worked on;
- `rec persistent`: the split variant's recurrence (records from the prep's scratch, v conv, both
  reductions, update, output) in that persistent form, alone and after the prep kernel; also
  without the barrier before the conv-window store (racy: timing only), to see whether the
  barrier is what keeps Triton from pipelining the loop;
- `onepass ring step`: the whole step in one launch per (row, head, V block) unit, the q/k prep
  recomputed by every unit, over a W-column conv window whose last column takes the new input
  (nothing read is overwritten, so no barrier and no ready counters); timing only, the window
  does not rotate;
- the split variant (prep + recurrence, and the recurrence alone) and fla's step, for reference.

    PYTHONPATH=src:benchmarks python scripts/kda_stream_probe.py [--requests 36,128]

Needs fla-core (the baseline). Findings: docs/perf/kda.md, "Streaming floor probe".
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from fla_tuning import fastest
from kda_decode import (
    C,
    H,
    K,
    V,
    W,
    copy_bandwidth,
    fla_conv_tuner,
    fla_path,
    make_inputs,
    ours,
    split_stages,
    time_graph,
)
from tokenspeed.model.ops.kda.decode import (
    decode_scratch,
    kda_decode,
    kda_decode_stages,
    scratch_width,
)
from tokenspeed.model.ops.kda.decode_kernels import (
    _add_pairs,
    _conv_silu,
    _conv_window,
    _load_record,
    _store_window,
)


@triton.jit
def _unit(
    u, slots_ptr, state_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr
):
    """Work unit u = (row, head, V block): (row, head, V block, its V columns, the row's slot,
    pointers of its K x BV state tile)."""
    NV = V // BV
    vb = u % NV
    head = u // NV % H
    row = u // NV // H
    ov = vb * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    tile = state_ptr + (slot * H + head) * K * V + tl.arange(0, K)[:, None] * V + ov[None, :]
    return row, head, vb, ov, slot, tile  # fmt: skip


@triton.jit
def _rmw_grid(
    state_ptr, slots_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)
    _, _, _, _, _, ptr = _unit(pid, slots_ptr, state_ptr, H, K, V, BV)
    s = tl.load(ptr, eviction_policy="evict_first")
    tl.store(ptr, s * 0.999 + 1e-3, eviction_policy="evict_first")


@triton.jit
def _rmw_persistent(
    state_ptr,
    slots_ptr,
    n_units,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    NPROG: tl.constexpr,
    NS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    for u in tl.range(pid, n_units, NPROG, num_stages=NS):
        _, _, _, _, _, ptr = _unit(u, slots_ptr, state_ptr, H, K, V, BV)
        s = tl.load(ptr)
        tl.store(ptr, s * 0.999 + 1e-3)


@triton.jit
def _rec_persistent(
    qkv_ptr,
    conv_w_ptr,
    conv_state_ptr,
    scratch_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    stride_qkv_b,
    n_units,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    NPROG: tl.constexpr,
    NS: tl.constexpr,
    USE_PDL: tl.constexpr,
    BARRIER: tl.constexpr = True,
):
    """The split recurrence at one token per row, as a persistent loop over (row, head, V block)
    units (grid wait on the prep kernel)."""
    pid = tl.program_id(0).to(tl.int64)
    C = 2 * H * K + H * V
    ok = tl.arange(0, K)
    cols = tl.arange(0, WP)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for u in tl.range(pid, n_units, NPROG, num_stages=NS):
        row, head, _, ov, slot, tile = _unit(u, slots_ptr, state_ptr, H, K, V, BV)
        v_ch = 2 * H * K + head * V + ov
        s = tl.load(tile)
        x_row = qkv_ptr + row * stride_qkv_b
        conv_row = conv_state_ptr + slot * C * (W - 1)
        v_win = _conv_window(x_row, 0, conv_row, v_ch, cols, 1, W)
        dq, k, decay, beta, qk = _load_record(scratch_ptr + (row * H + head) * D, ok, K)
        v = _conv_silu(v_win, conv_w_ptr, v_ch, cols, 0, W)
        uu, ww = tl.reduce((s * (decay * k)[:, None], s * dq[:, None]), 0, _add_pairs)
        delta = beta * (v - uu)
        s = s * decay[:, None] + k[:, None] * delta[None, :]
        o = ww + qk * delta
        tl.store(out_ptr + (row * H + head) * V + ov, o.to(out_ptr.dtype.element_ty))
        tl.store(tile, s)
        if BARRIER:
            tl.debug_barrier()
        _store_window(conv_row, v_win, v_ch, cols, 1, W)


@triton.jit
def _ring_conv(x_row, conv_row, w_ptr, ch, cw, W: tl.constexpr):
    """(SiLU(conv output), new input) of channels `ch` with a W-column window per channel whose
    columns 0..W-2 hold the last inputs (oldest first) and column W-1 takes the new one: nothing
    read is overwritten, so no barrier."""
    old = tl.load(conv_row + ch[:, None] * W + cw[None, :], mask=(cw < W - 1)[None, :], other=0.0)
    new = tl.load(x_row + ch)
    win = tl.where((cw < W - 1)[None, :], old.to(tl.float32), new.to(tl.float32)[:, None])
    taps = tl.load(w_ptr + ch[:, None] * W + cw[None, :]).to(tl.float32)
    y = tl.sum(win * taps, axis=1)
    return y * tl.sigmoid(y), new


@triton.jit
def _onepass_ring(
    qkv_ptr,
    f_ptr,
    beta_ptr,
    conv_w_ptr,
    a_log_ptr,
    dt_bias_ptr,
    conv_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    stride_qkv_b,
    stride_f_b,
    stride_beta_b,
    n_units,
    scale,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    W: tl.constexpr,
    BV: tl.constexpr,
    NPROG: tl.constexpr,
    NS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Whole step per (row, head, V block) unit, persistent: q/k conv + norms + gate + beta
    recomputed per unit, v conv of its own channels, recurrence; new inputs written to the
    window's free column (q/k by the head's first V block). One token per row. Timing probe: the
    window does not rotate (a ring would pick the columns from the position)."""
    pid = tl.program_id(0).to(tl.int64)
    C = 2 * H * K + H * V
    ok = tl.arange(0, K)
    cw = tl.arange(0, W)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for u in tl.range(pid, n_units, NPROG, num_stages=NS):
        row, head, vb, ov, slot, tile = _unit(u, slots_ptr, state_ptr, H, K, V, BV)
        q_ch = head * K + ok
        k_ch = H * K + head * K + ok
        v_ch = 2 * H * K + head * V + ov
        s = tl.load(tile)
        x_row = qkv_ptr + row * stride_qkv_b
        conv_row = conv_ptr + slot * C * W
        q, q_new = _ring_conv(x_row, conv_row, conv_w_ptr, q_ch, cw, W)
        k, k_new = _ring_conv(x_row, conv_row, conv_w_ptr, k_ch, cw, W)
        v, v_new = _ring_conv(x_row, conv_row, conv_w_ptr, v_ch, cw, W)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        f = tl.load(f_ptr + row * stride_f_b + head * K + ok).to(tl.float32)
        a_log = tl.load(a_log_ptr + head).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head * K + ok).to(tl.float32)
        decay = tl.exp(lower_bound * tl.sigmoid(tl.exp(a_log) * (f + dt_bias)))
        beta = tl.sigmoid(tl.load(beta_ptr + row * stride_beta_b + head).to(tl.float32))
        dq = decay * q
        qk = tl.sum(q * k, axis=0)
        uu, ww = tl.reduce((s * (decay * k)[:, None], s * dq[:, None]), 0, _add_pairs)
        delta = beta * (v - uu)
        s = s * decay[:, None] + k[:, None] * delta[None, :]
        o = ww + qk * delta
        tl.store(out_ptr + (row * H + head) * V + ov, o.to(out_ptr.dtype.element_ty))
        tl.store(tile, s)
        tl.store(conv_row + v_ch * W + (W - 1), v_new)
        first = ok < (vb == 0).to(tl.int32) * K
        tl.store(conv_row + q_ch * W + (W - 1), q_new, mask=first)
        tl.store(conv_row + k_ch * W + (W - 1), k_new, mask=first)


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def persistent_rec(inp, scratch, out, bv, warps, nprog, ns, pdl=True, barrier=True):
    batch = inp["qkv"].shape[0]
    n_units = batch * H * (V // bv)
    grid = (min(nprog, n_units),)
    launch = {"launch_pdl": True} if pdl else {}

    def run():
        _rec_persistent[grid](
            inp["qkv"],
            inp["conv_weight"],
            inp["conv_state"],
            scratch,
            inp["recurrent_state"],
            inp["slots"],
            out,
            inp["qkv"].stride(0),
            n_units,
            H=H,
            K=K,
            V=V,
            W=W,
            WP=triton.next_power_of_2(W),
            D=scratch_width(K),
            BV=bv,
            NPROG=grid[0],
            NS=ns,
            USE_PDL=pdl,
            BARRIER=barrier,
            num_warps=warps,
            **launch,
        )

    return run


def check_persistent(bv, warps, nprog, ns) -> str:
    """Compare the persistent recurrence (after the split prep) with the split variant."""
    a = make_inputs(8, 1, seed=3)
    b = {k: v.clone() for k, v in a.items()}
    ref = kda_decode(**a, gate="lower_bound", lower_bound=-5.0, variant="split", overlap_prep=False)
    scratch = decode_scratch(8, 1, H, K, "cuda")
    counters = torch.zeros(8, H, dtype=torch.int32, device="cuda")
    prep, _ = kda_decode_stages(
        **b,
        gate="lower_bound",
        lower_bound=-5.0,
        variant="split",
        scratch=scratch,
        counters=counters,
        overlap_prep=False,
    )
    out = torch.empty(8, 1, H, V, dtype=torch.bfloat16, device="cuda")
    prep()
    persistent_rec(b, scratch, out, bv, warps, nprog, ns)()
    torch.cuda.synchronize()
    errs = [
        (ref.float() - out.float()).abs().max().item(),
        (a["recurrent_state"] - b["recurrent_state"]).abs().max().item(),
        (a["conv_state"].float() - b["conv_state"].float()).abs().max().item(),
    ]
    return "ok" if max(errs) < 2e-2 else f"MISMATCH {errs}"


def ring_step(inp, conv4, out, bv, warps, nprog, ns):
    """The `_onepass_ring` step over `inp` with the W-column window `conv4`, as a callable."""
    n_units = inp["qkv"].shape[0] * H * (V // bv)

    def run():
        _onepass_ring[(nprog,)](
            inp["qkv"], inp["f"], inp["beta"], inp["conv_weight"], inp["a_log"], inp["dt_bias"],
            conv4, inp["recurrent_state"], inp["slots"], out, inp["qkv"].stride(0),
            inp["f"].stride(0), inp["beta"].stride(0), n_units, K**-0.5, -5.0,
            H=H, K=K, V=V, W=W, BV=bv, NPROG=nprog, NS=ns, USE_PDL=True, num_warps=warps,
            launch_pdl=True,
        )  # fmt: skip

    return run, n_units


def rmw_grid(state, slots, bv, warps):
    grid = (state.shape[0] - 1) * H * (V // bv)
    return lambda: _rmw_grid[(grid,)](state, slots, H=H, K=K, V=V, BV=bv, num_warps=warps)


def rmw_persistent(state, slots, bv, warps, nprog, ns):
    n_units = (state.shape[0] - 1) * H * (V // bv)
    nprog = min(nprog, n_units)
    return lambda: _rmw_persistent[(nprog,)](
        state, slots, n_units, H=H, K=K, V=V, BV=bv, NPROG=nprog, NS=ns, num_warps=warps
    )


def timed(record, name, make) -> None:
    """Time `make()`'s callable under `name`, or report why it could not run."""
    try:
        us = time_graph(make())
    except Exception as exc:  # a config the device cannot run: report it and go on
        print(f"{name}: {type(exc).__name__} {str(exc)[:150]}", flush=True)
        return
    record(name, us)


def probe_batch(batch: int, sms: int, bw: float, ok_configs: list) -> None:
    inp = make_inputs(batch, 1, seed=batch)
    rows = []

    def record(name, us):
        rows.append((name, us))
        frac = 2 * batch * H * K * V * 4 / (us * 1e-6) / bw
        print(f"{batch:4d} | {name:55s} | {us:8.1f} us | {100 * frac:5.1f}% of copy", flush=True)

    state, slots = inp["recurrent_state"], inp["slots"]
    for bv, warps in ((64, 4), (32, 4), (32, 2)):
        timed(record, f"rmw grid bv={bv} warps={warps}",
              lambda bv=bv, warps=warps: rmw_grid(state, slots, bv, warps))  # fmt: skip
    for m, ns in ((2, 1), (2, 3), (3, 1), (3, 3)):
        timed(record, f"rmw persistent bv=64 warps=4 {m}x{sms} ns={ns}",
              lambda m=m, ns=ns: rmw_persistent(state, slots, 64, 4, m * sms, ns))  # fmt: skip

    scratch = decode_scratch(batch, 1, H, K, "cuda")
    counters = torch.zeros(batch, H, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, 1, H, V, dtype=torch.bfloat16, device="cuda")
    prep, _ = kda_decode_stages(
        **inp, gate="lower_bound", lower_bound=-5.0, variant="split", scratch=scratch,
        counters=counters, overlap_prep=False,
    )  # fmt: skip
    for bv, warps, m, ns in ok_configs:
        rec = persistent_rec(inp, scratch, out, bv, warps, m * sms, ns)
        record(f"rec persistent alone bv={bv} warps={warps} {m}x{sms} ns={ns}", time_graph(rec))
        record(
            f"prep + rec persistent bv={bv} warps={warps} {m}x{sms} ns={ns}",
            time_graph(lambda rec=rec: (prep(), rec())),
        )
    for m in (2, 3):
        for ns in (1, 2, 3):
            rec = persistent_rec(inp, scratch, out, 64, 4, m * sms, ns, barrier=False)
            record(f"rec persistent no barrier (racy) bv=64 {m}x{sms} ns={ns}", time_graph(rec))
    conv4 = torch.randn(batch + 1, C, W, device="cuda").to(torch.bfloat16)
    ring_configs = (
        [(64, 4, m, ns) for m in (2, 3, 4, 0) for ns in (1, 2, 3)]
        + [(32, 4, m, ns) for m in (4, 6, 0) for ns in (1, 2)]
        + [(64, 8, m, ns) for m in (1, 2, 0) for ns in (1, 2)]
    )
    for bv, warps, m, ns in ring_configs:  # m = 0: one program per unit
        nprog = m * sms if m else batch * H * (V // bv)
        grid = f"{m}x{sms}" if m else "grid"
        timed(record, f"onepass ring step bv={bv} warps={warps} {grid} ns={ns}",
              lambda bv=bv, warps=warps, nprog=nprog, ns=ns:
              ring_step(inp, conv4, out, bv, warps, nprog, ns)[0])  # fmt: skip
    _, recurrence = split_stages(inp, "lower_bound")
    record("split recurrence alone (counters)", time_graph(recurrence))
    record("split step (counters)", time_graph(ours(inp, "lower_bound", "split")))
    record(
        "split step (grid wait)", time_graph(ours(inp, "lower_bound", "split", overlap_prep=False))
    )
    base = {k: v.clone() for k, v in inp.items()}
    t_fla, best = fastest(fla_conv_tuner(), lambda: time_graph(fla_path(base, "lower_bound")))
    record(f"fla step (conv config {best})", t_fla)
    best_ours = min(us for name, us in rows if "step" in name or "prep +" in name)
    print(f"{batch:4d} | best ours {best_ours:.1f} us -> {t_fla / best_ours:.3f}x fla", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", default="36,128")
    args = p.parse_args()
    sms = num_sms()
    bw = copy_bandwidth()
    print(
        f"device {torch.cuda.get_device_name()}, {sms} SMs, copy {bw / 1e12:.2f} TB/s, "
        f"triton {triton.__version__}",
        flush=True,
    )
    ok_configs = []
    for bv, warps, m, ns in [(64, 4, 3, 1)]:
        try:
            verdict = check_persistent(bv, warps, m * sms, ns)
        except Exception as exc:  # a compile or launch failure: report it and go on
            verdict = f"ERROR {type(exc).__name__}: {str(exc)[:200]}"
        print(f"check rec persistent bv={bv} warps={warps} {m}x{sms} ns={ns}: {verdict}")
        if verdict == "ok":
            ok_configs.append((bv, warps, m, ns))
    for batch in [int(b) for b in args.requests.split(",")]:
        probe_batch(batch, sms, bw, ok_configs)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    main()
