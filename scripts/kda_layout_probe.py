"""Probe: how fast do passes over the fp32 KDA state stream, by tile layout and cache hints?

Does the state stream faster as [V, K] per head (each program's tile one contiguous block) than
as the pool's [K, V] (each tile K rows of BV floats, strided)? And which L2 eviction policies
should the tile's load and store carry (kda_decode's `state_eviction`)?

The split recurrence's tile is K x BV of a [K, V] state: 128 runs of BV * 4 bytes, 512 bytes
apart, interleaved with the other V blocks' runs. In a [V, K] layout the same tile (BV value
columns, all of K) is BV * K * 4 contiguous bytes, and the reductions over K run along the
contiguous axis, inside warps. Times, per request count (CUDA graph, L2 flushed before each
replay, as benchmarks/kda_decode.py does):
- `rmw`: each tile read through its slot, scaled, written back; one program per tile;
- `math`: the recurrence's state math on the same tiles (records and v as plain inputs: both
  reductions, the update, the output; no conv, no counters), the "probe 1" of docs/perf/kda.md;
- each under a few (load, store) eviction policies of the tile;
- `torch copy`: the state's bytes copied to another buffer (read + write, no kernel of ours),
  and `torch mul_`: the same bytes scaled in place;
- with --flat: in-place scaling of BLOCK contiguous floats per program, and the `rmw` tiles
  written out of place (to the same offsets of another pool), to tell the in-place pattern
  from the tile shape;
- the split step (and its recurrence alone) and the onepass step at each `state_eviction`;
  fla's step and recurrent kernel over either pool layout (its `state_v_first`).

    PYTHONPATH=src:benchmarks python scripts/kda_layout_probe.py [--requests 36,64,128]

Findings: docs/perf/kda.md, "Cache eviction hints on the state tiles".
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from cuda_timing import time_graph
from kda_decode import H, K, V, copy_bandwidth, fla_path, make_inputs, ours, split_stages
from tokenspeed.model.ops.kda.decode_kernels import _add_pairs, _load_record

D = 3 * K + 2  # record: e^g q | k | e^g | beta | q.k
# (load, store) eviction policies: of the probe's tiles, of kda_decode's state tiles, and those
# under which the split variant's (block_v, num_warps) are swept
TILE_EVICTIONS = [("evict_first", "evict_first"), ("", ""), ("evict_last", "evict_last")]
FIRST, LAST = "evict_first", "evict_last"
STEP_EVICTIONS = [(a, b) for a in (FIRST, "", LAST) for b in (FIRST, "", LAST)]
SWEEP_EVICTIONS = [(LAST, LAST), (LAST, "")]
SWEEP = ((32, 2), (32, 4), (64, 8), (128, 8))
# (floats per program, warps, evict-first hints) of the flat in-place streams
FLAT = [(b, w, h) for b, w in ((512, 4), (1024, 4), (1024, 8), (2048, 4)) for h in (True, False)]


@triton.jit
def _tile(slots_ptr, pid, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          BV: tl.constexpr, TRANS: tl.constexpr):  # fmt: skip
    """(row, head, its BV value columns, the tile's offsets in the pool: [BV, K] if TRANS else
    [K, BV])."""
    NV = V // BV
    vb = pid % NV
    head = pid // NV % H
    row = pid // NV // H
    ov = vb * BV + tl.arange(0, BV)
    ok = tl.arange(0, K)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    base = (slot * H + head) * K * V
    offs = base + (ov[:, None] * K + ok[None, :] if TRANS else ok[:, None] * V + ov[None, :])
    return row, head, ov, offs


@triton.jit
def _rmw(state_ptr, slots_ptr, dst_ptr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
         BV: tl.constexpr, TRANS: tl.constexpr, EVICT_LOAD: tl.constexpr,
         EVICT_STORE: tl.constexpr):  # fmt: skip
    """Each tile read, scaled and written to the same offsets of dst (the pool itself: in
    place)."""
    pid = tl.program_id(0).to(tl.int64)
    _, _, _, offs = _tile(slots_ptr, pid, H, K, V, BV, TRANS)
    s = tl.load(state_ptr + offs, eviction_policy=EVICT_LOAD)
    tl.store(dst_ptr + offs, s * 0.999 + 1e-3, eviction_policy=EVICT_STORE)


@triton.jit
def _rmw_flat(x_ptr, BLOCK: tl.constexpr, HINT: tl.constexpr):
    """In-place read-scale-write of BLOCK contiguous floats per program (HINT: evict-first)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HINT:
        x = tl.load(x_ptr + offs, eviction_policy="evict_first")
        tl.store(x_ptr + offs, x * 0.999 + 1e-3, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr + offs)
        tl.store(x_ptr + offs, x * 0.999 + 1e-3)


@triton.jit
def _math(state_ptr, slots_ptr, rec_ptr, v_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr,
          V: tl.constexpr, D: tl.constexpr, BV: tl.constexpr, TRANS: tl.constexpr,
          EVICT_LOAD: tl.constexpr, EVICT_STORE: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    row, head, ov, offs = _tile(slots_ptr, pid, H, K, V, BV, TRANS)
    s = tl.load(state_ptr + offs, eviction_policy=EVICT_LOAD)
    ok = tl.arange(0, K)
    dq, k, decay, beta, qk = _load_record(rec_ptr + (row * H + head) * D, ok, K)
    v = tl.load(v_ptr + (row * H + head) * V + ov).to(tl.float32)
    if TRANS:  # s[j, i] = S[i, j]: reductions over K along axis 1
        u, w = tl.reduce((s * (decay * k)[None, :], s * dq[None, :]), 1, _add_pairs)
        delta = beta * (v - u)
        s = s * decay[None, :] + delta[:, None] * k[None, :]
    else:
        u, w = tl.reduce((s * (decay * k)[:, None], s * dq[:, None]), 0, _add_pairs)
        delta = beta * (v - u)
        s = s * decay[:, None] + k[:, None] * delta[None, :]
    o = w + qk * delta
    tl.store(out_ptr + (row * H + head) * V + ov, o.to(out_ptr.dtype.element_ty))
    tl.store(state_ptr + offs, s, eviction_policy=EVICT_STORE)


def reference_math(state, slots, rec, v, trans: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 torch form of `_math`: (o [B, H, V], new states of the rows, in the [K, V] form)."""
    s = state[slots.long()]
    if trans:
        s = s.transpose(-1, -2)
    dq, k, decay = rec[..., :K], rec[..., K : 2 * K], rec[..., 2 * K : 3 * K]
    beta, qk = rec[..., 3 * K], rec[..., 3 * K + 1]
    u = torch.einsum("bhkv,bhk->bhv", s, decay * k)
    w = torch.einsum("bhkv,bhk->bhv", s, dq)
    delta = beta[..., None] * (v.float() - u)
    new = s * decay[..., None] + k[..., None] * delta[..., None, :]
    return w + qk[..., None] * delta, new


def check(batch: int) -> None:
    """Both layouts' `_math` against the torch form (one config each)."""
    inp = make_inputs(batch, 1, seed=7)
    rec = torch.randn(batch, H, D, device="cuda") * 0.1
    v = torch.randn(batch, H, V, device="cuda").to(torch.bfloat16)
    for trans in (False, True):
        state = inp["recurrent_state"].clone()
        if trans:
            state = state.transpose(-1, -2).contiguous()
        o_ref, s_ref = reference_math(state, inp["slots"], rec, v, trans)
        out = torch.empty(batch, H, V, device="cuda", dtype=torch.bfloat16)
        grid = (batch * H * 2,)
        _math[grid](state, inp["slots"], rec, v, out, H=H, K=K, V=V, D=D, BV=64, TRANS=trans,
                    EVICT_LOAD="", EVICT_STORE="", num_warps=4)  # fmt: skip
        s_new = state[inp["slots"].long()]
        if trans:
            s_new = s_new.transpose(-1, -2)
        torch.testing.assert_close(out.float(), o_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(s_new, s_ref, atol=1e-4, rtol=1e-4)
    print("check: both layouts match the torch form", flush=True)


def launcher(kernel, grid, *args, **kw):
    return lambda: kernel[grid](*args, **kw)


def probe(batch: int, bw: float, configs: list[tuple[int, int]], layouts: bool, flat: bool) -> None:
    inp = make_inputs(batch, 1, seed=batch)
    state, slots = inp["recurrent_state"], inp["slots"]
    rec = torch.randn(batch, H, D, device="cuda") * 0.1
    v = torch.randn(batch, H, V, device="cuda").to(torch.bfloat16)
    out = torch.empty(batch, H, V, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * batch * H * K * V * 4
    rows = []

    def record(name, fn):
        us = time_graph(fn)
        rows.append((name, us, nbytes / (us * 1e-6) / bw))
        print(f"{batch} | {name} | {us:.1f} us | {rows[-1][2]:.0%}", flush=True)

    src = state[1:].clone()
    dst = torch.empty_like(src)
    record("torch copy of the state bytes", lambda: dst.copy_(src))
    record("torch in-place mul_ of the state bytes", lambda: src.mul_(0.999))
    if flat:
        for block, warps, hint in FLAT:
            kw = dict(BLOCK=block, HINT=hint, num_warps=warps)
            record(f"rmw flat {block} floats w {warps}{'' if hint else ', no hints'}",
                   launcher(_rmw_flat, (src.numel() // block,), src, **kw))  # fmt: skip
        pool_out = torch.empty_like(state)
        for bv, warps in configs:
            kw = dict(H=H, K=K, V=V, BV=bv, TRANS=False, num_warps=warps)
            kw.update(EVICT_LOAD="", EVICT_STORE="")
            grid = (batch * H * (V // bv),)
            record(f"rmw [K, V] BV {bv} w {warps}, out of place",
                   launcher(_rmw, grid, state, slots, pool_out, **kw))  # fmt: skip
    for bv, warps in configs if layouts else ():
        grid = (batch * H * (V // bv),)
        for trans in (False, True):
            lay = "[V, K]" if trans else "[K, V]"
            for load, store in TILE_EVICTIONS:
                tag = f"{lay} BV {bv} w {warps} {load or 'none'}/{store or 'none'}"
                kw = dict(H=H, K=K, V=V, BV=bv, TRANS=trans, num_warps=warps)
                kw.update(EVICT_LOAD=load, EVICT_STORE=store)
                record(f"rmw {tag}", launcher(_rmw, grid, state, slots, state, **kw))
                record(f"math {tag}", launcher(_math, grid, state, slots, rec, v, out, D=D, **kw))
    for evict in STEP_EVICTIONS:
        tag = f"state_eviction {evict}"
        record(f"split step, {tag}", ours(inp, "lower_bound", state_eviction=evict))
        _, recurrence = split_stages(inp, "lower_bound", state_eviction=evict)
        record(f"split recurrence alone, {tag}", recurrence)
    for evict in SWEEP_EVICTIONS:
        record(f"onepass step, {evict}", ours(inp, "lower_bound", "onepass", state_eviction=evict))
        for bv, warps in SWEEP:
            kw = dict(state_eviction=evict, block_v=bv, num_warps=warps)
            record(f"split step, {evict}, ({bv}, {warps})", ours(inp, "lower_bound", **kw))
    v_first = dict(inp, recurrent_state=state.transpose(-1, -2).contiguous())
    for name, pool, vf in (("[K, V]", inp, False), ("[V, K]", v_first, True)):
        record(f"fla step, {name} pool", fla_path(pool, "lower_bound", state_v_first=vf))
        record(f"fla recurrent only, {name} pool",
               fla_path(pool, "lower_bound", recurrent_only=True, state_v_first=vf))  # fmt: skip
    print(f"\n{batch} requests: | kernel | us | % of copy |\n|---|---:|---:|")
    for name, us, frac in rows:
        print(f"| {name} | {us:.1f} | {frac:.0%} |")
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="36,64,128")
    parser.add_argument("--configs", default="64,4 32,4 32,2 64,8", help="BV,warps pairs")
    parser.add_argument("--no-layouts", action="store_true", help="skip the layout A/B")
    parser.add_argument("--flat", action="store_true", help="also flat and out-of-place streams")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split()]
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s")
    check(8)
    for batch in (int(b) for b in args.requests.split(",")):
        probe(batch, bw, configs, not args.no_layouts, args.flat)


if __name__ == "__main__":
    main()
