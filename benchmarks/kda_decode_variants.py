"""The comparison forms of the KDA decode step, timed against the default by
benchmarks/kda_decode.py (`--variants`). No default path launches them, so they live here, not
in the package.

"onepass", one launch, one program per (row, head, V block): the split recurrence with the prep
  folded in. Every V block of a head recomputes the head's q/k conv, norms and gate (a few KiB
  from L2 next to its 16 KiB state tile) and the conv of its own v channels; the q/k windows are
  rewritten by whichever program of the head reads them last, found with an atomic counter per
  (row, head) (`counters`, zero before and after each launch). No scratch round trip and no
  second launch, at the price of a longer program and the counter buffer.
"fused", one launch, one program per (row, head): conv, norms, gate and recurrence in
  registers, walking V in blocks (the first design). It gives each head one program because
  the q/k conv window of a head is read by every V block and must be shifted in place
  afterwards, with no order between the programs of a grid; so each program streams a whole
  64 KiB head state serially, with few programs per SM (measured at ~37% of copy bandwidth on
  the H200; the split and onepass forms exist to fix that).

`kda_decode_variant(..., variant=...)` takes `kda_decode`'s arguments; "split" is
`kda_decode` itself. Same math and results as the references (checked by the benchmark before
it times anything).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.model.ops.kda.decode import (
    KdaDecodeTuning,
    check_gate_form,
    check_inputs,
    kda_decode,
    pdl_enabled,
)
from tokenspeed.model.ops.kda.decode import default_config as split_config
from tokenspeed.model.ops.kda.decode_kernels import (
    _add_pairs,
    _conv_silu_taps,
    _conv_window,
    _gate,
    _l2norm,
    _qk_windows,
    _step_conv_row,
    _store_qk_windows,
    _store_step_windows,
    _store_window,
    _token_gate,
)

VARIANTS = ("split", "onepass", "fused")


@triton.jit
def _conv_silu(window, w_ptr, ch, cols, t, W: tl.constexpr):
    """SiLU(conv output of token t) for channels `ch`: [N]. Tap j multiplies window column t+j,
    so tap W-1 meets the token's own input."""
    tap = cols - t
    valid = (tap >= 0) & (tap < W)
    taps = tl.load(
        w_ptr + ch[:, None] * W + tl.maximum(tap, 0)[None, :], mask=valid[None, :], other=0.0
    )
    y = tl.sum(window * taps.to(tl.float32), axis=1)
    return y * tl.sigmoid(y)


@triton.jit
def _update_qk_conv_state(
    x_row, stride_t, conv_row, q_ch, k_ch, cols, T: tl.constexpr, W: tl.constexpr
):
    """Advance a head's q/k conv state past the T new tokens: load its windows, then store
    their last W-1 columns in place."""
    q_win, k_win = _qk_windows(x_row, stride_t, conv_row, q_ch, k_ch, cols, T, W)
    # All lanes must have read the old window before any lane overwrites it.
    tl.debug_barrier()
    _store_qk_windows(conv_row, q_win, k_win, q_ch, k_ch, cols, T, W)


@triton.jit
def _store_step_qk_windows(
    step_conv_ptr,
    row,
    q_win,
    k_win,
    q_ch,
    k_ch,
    cols,
    C: tl.constexpr,
    T: tl.constexpr,
    W: tl.constexpr,
):
    """`_store_step_windows` of a head's q and k windows, interleaved: per token, q's then k's."""
    for t in tl.static_range(T):
        step_conv = _step_conv_row(step_conv_ptr, row, t, C, T, W)
        _store_qk_windows(step_conv, q_win, k_win, q_ch, k_ch, cols, t + 1, W)


@triton.jit
def _kda_decode_kernel(
    qkv_ptr,  # [B, T, C] pre-conv q|k|v, C = 2*H*K + H*V
    f_ptr,  # [B, T, H*K] raw gate (before dt_bias)
    beta_ptr,  # [B, T, H] raw beta (before sigmoid)
    conv_w_ptr,  # [C, W]
    a_log_ptr,  # [H]
    dt_bias_ptr,  # [H*K]
    conv_state_ptr,  # [S, C, W-1] pool, updated in place
    state_ptr,  # [S, H, K, V] fp32 pool, updated in place
    slots_ptr,  # [B]
    out_ptr,  # [B, T, H, V]
    step_state_ptr,  # [B, T, H, K, V] fp32 or None
    step_conv_ptr,  # [B, T, C, W-1] or None
    stride_qkv_b,
    stride_qkv_t,
    stride_f_b,
    stride_f_t,
    stride_beta_b,
    stride_beta_t,
    scale,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    T: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,  # next power of two >= W - 1 + T
    BV: tl.constexpr,
    LOWER_BOUND: tl.constexpr,
    STORE_STEPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVICT_LOAD: tl.constexpr,  # cache eviction policy of the state tile's load
    EVICT_STORE: tl.constexpr,  # ... and of its store
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // H
    head = pid % H
    C = 2 * H * K + H * V
    ok = tl.arange(0, K)
    cols = tl.arange(0, WP)
    q_ch = head * K + ok
    k_ch = H * K + head * K + ok

    if USE_PDL:
        # Everything below reads what the previous kernels wrote (projections, state pools).
        # The next kernel may start launching now; it waits on its own gdc_wait for our results.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    slot = tl.load(slots_ptr + row).to(tl.int64)
    x_row = qkv_ptr + row * stride_qkv_b
    conv_row = conv_state_ptr + slot * C * (W - 1)
    q_win, k_win = _qk_windows(x_row, stride_qkv_t, conv_row, q_ch, k_ch, cols, T, W)
    a_log = tl.load(a_log_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head * K + ok).to(tl.float32)
    f_row = f_ptr + row * stride_f_b + head * K + ok
    beta_row = beta_ptr + row * stride_beta_b + head
    state_head = state_ptr + (slot * H + head) * K * V
    out_row = out_ptr + (row * T * H + head) * V

    # The first V block's state tile and v window; each iteration prefetches the next block's
    # before computing its own, so a program always has a tile load in flight.
    s = tl.load(
        state_head + ok[:, None] * V + tl.arange(0, BV)[None, :], eviction_policy=EVICT_LOAD
    )  # [K, BV] fp32, read once per step
    v_win = _conv_window(
        x_row, stride_qkv_t, conv_row, 2 * H * K + head * V + tl.arange(0, BV), cols, T, W
    )
    for v0 in range(0, V, BV):
        ov = v0 + tl.arange(0, BV)
        v_ch = 2 * H * K + head * V + ov
        tile = ok[:, None] * V + ov[None, :]
        if BV < V:
            more = ov + BV < V
            s_next = tl.load(
                state_head + tile + BV, mask=more[None, :], other=0.0, eviction_policy=EVICT_LOAD
            )
            # past the last block: re-read the last window (cached) rather than run off the end
            v_win_next = _conv_window(
                x_row, stride_qkv_t, conv_row, tl.where(more, v_ch + BV, v_ch), cols, T, W
            )
        for t in tl.static_range(T):
            # q/k/g of the token are recomputed per V block: cheap next to the state traffic,
            # and they never leave registers.
            q = _l2norm(_conv_silu(q_win, conv_w_ptr, q_ch, cols, t, W)) * scale
            k = _l2norm(_conv_silu(k_win, conv_w_ptr, k_ch, cols, t, W))
            v = _conv_silu(v_win, conv_w_ptr, v_ch, cols, t, W)
            f = tl.load(f_row + t * stride_f_t).to(tl.float32)
            g = _gate(f, a_log, dt_bias, lower_bound, LOWER_BOUND)
            beta = tl.sigmoid(tl.load(beta_row + t * stride_beta_t).to(tl.float32))
            s = s * tl.exp(g)[:, None]
            delta = beta * (v - tl.sum(s * k[:, None], axis=0))
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(s * q[:, None], axis=0)
            tl.store(out_row + t * H * V + ov, o.to(out_ptr.dtype.element_ty))
            if STORE_STEPS:
                step = step_state_ptr + ((row * T + t) * H + head) * K * V
                tl.store(step + tile, s)
                step_conv = _step_conv_row(step_conv_ptr, row, t, C, T, W)
                _store_window(step_conv, v_win, v_ch, cols, t + 1, W)
        tl.store(state_head + tile, s, eviction_policy=EVICT_STORE)
        # All lanes must have read the old window before any lane overwrites it.
        tl.debug_barrier()
        _store_window(conv_row, v_win, v_ch, cols, T, W)
        if BV < V:
            s = s_next
            v_win = v_win_next

    if STORE_STEPS:
        _store_step_qk_windows(step_conv_ptr, row, q_win, k_win, q_ch, k_ch, cols, C, T, W)
    tl.debug_barrier()
    _store_qk_windows(conv_row, q_win, k_win, q_ch, k_ch, cols, T, W)


@triton.jit
def _kda_onepass_kernel(
    qkv_ptr,  # [B, T, C] pre-conv q|k|v, C = 2*H*K + H*V
    f_ptr,  # [B, T, H*K] raw gate (before dt_bias)
    beta_ptr,  # [B, T, H] raw beta (before sigmoid)
    conv_w_ptr,  # [C, W]
    a_log_ptr,  # [H]
    dt_bias_ptr,  # [H*K]
    conv_state_ptr,  # [S, C, W-1] pool, updated in place
    state_ptr,  # [S, H, K, V] fp32 pool, updated in place
    slots_ptr,  # [B]
    out_ptr,  # [B, T, H, V]
    counter_ptr,  # [B, H] int32, zero before and after the launch
    step_state_ptr,  # [B, T, H, K, V] fp32 or None
    step_conv_ptr,  # [B, T, C, W-1] or None
    stride_qkv_b,
    stride_qkv_t,
    stride_f_b,
    stride_f_t,
    stride_beta_b,
    stride_beta_t,
    scale,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    T: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,  # next power of two >= W - 1 + T
    BV: tl.constexpr,
    LOWER_BOUND: tl.constexpr,
    STORE_STEPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVICT_LOAD: tl.constexpr,  # cache eviction policy of the state tile's load
    EVICT_STORE: tl.constexpr,  # ... and of its store
):
    """The onepass variant, one program per (row, head, V block): the split recurrence with the
    prep done in place (q/k recomputed by each of a head's V blocks, v for the block's own
    channels). The q/k conv windows of the head are rewritten by whichever of its programs reads
    them last, found with an atomic counter per (row, head)."""
    pid = tl.program_id(0).to(tl.int64)
    NV = V // BV  # constexpr
    vb = pid % NV
    row_head = pid // NV
    row = row_head // H
    head = row_head % H
    C = 2 * H * K + H * V
    ok = tl.arange(0, K)
    ov = vb * BV + tl.arange(0, BV)
    cols = tl.arange(0, WP)
    q_ch = head * K + ok
    k_ch = H * K + head * K + ok
    v_ch = 2 * H * K + head * V + ov
    tile = ok[:, None] * V + ov[None, :]

    if USE_PDL:
        # The previous kernel may be this layer's previous step: wait before touching any pool.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    slot = tl.load(slots_ptr + row).to(tl.int64)
    state_tile = state_ptr + (slot * H + head) * K * V + tile
    s = tl.load(state_tile, eviction_policy=EVICT_LOAD)  # [K, BV] fp32, touched once
    x_row = qkv_ptr + row * stride_qkv_b
    conv_row = conv_state_ptr + slot * C * (W - 1)
    a_log = tl.load(a_log_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head * K + ok).to(tl.float32)
    f_row = f_ptr + row * stride_f_b + head * K + ok
    beta_row = beta_ptr + row * stride_beta_b + head
    out_row = out_ptr + (row * T * H + head) * V + ov

    for t in tl.static_range(T):
        # The conv outputs come from 1-D tap loads (`_conv_silu_taps`), not from the windows:
        # consuming a reduction over a [K, WP] window makes the compiler move the whole state
        # tile into the window's layout (a 16 KiB round trip through shared memory).
        x_q = _conv_silu_taps(x_row, stride_qkv_t, conv_row, conv_w_ptr, q_ch, t, W)
        x_k = _conv_silu_taps(x_row, stride_qkv_t, conv_row, conv_w_ptr, k_ch, t, W)
        v = _conv_silu_taps(x_row, stride_qkv_t, conv_row, conv_w_ptr, v_ch, t, W)
        q = _l2norm(x_q) * scale
        k = _l2norm(x_k)
        decay, beta = _token_gate(
            f_row, beta_row, t, stride_f_t, stride_beta_t, a_log, dt_bias, lower_bound, LOWER_BOUND
        )
        u, w = tl.reduce((s * (decay * k)[:, None], s * (decay * q)[:, None]), 0, _add_pairs)
        delta = beta * (v - u)
        s = s * decay[:, None] + k[:, None] * delta[None, :]
        o = w + tl.sum(q * k, axis=0) * delta
        tl.store(out_row + t * H * V, o.to(out_ptr.dtype.element_ty))
        if STORE_STEPS:
            tl.store(step_state_ptr + ((row * T + t) * H + head) * K * V + tile, s)
    tl.store(state_tile, s, eviction_policy=EVICT_STORE)

    # The conv windows, as [N, WP] tiles, are loaded only now, for the stores (they would only
    # hold registers during the recurrence). Every load of the old q/k conv state above has been
    # consumed (the tile was computed from it) before this program's counter increment below.
    v_win = _conv_window(x_row, stride_qkv_t, conv_row, v_ch, cols, T, W)
    if STORE_STEPS:
        _store_step_windows(step_conv_ptr, row, v_win, v_ch, cols, C, T, W)
        if vb == 0:  # the q/k step windows, once per head
            q_win, k_win = _qk_windows(x_row, stride_qkv_t, conv_row, q_ch, k_ch, cols, T, W)
            _store_step_qk_windows(step_conv_ptr, row, q_win, k_win, q_ch, k_ch, cols, C, T, W)
    # All lanes must have read the old window before any lane overwrites it.
    tl.debug_barrier()
    _store_window(conv_row, v_win, v_ch, cols, T, W)  # this block's own v channels
    if NV == 1:
        _update_qk_conv_state(x_row, stride_qkv_t, conv_row, q_ch, k_ch, cols, T, W)
    else:
        # The q/k windows of the head are rewritten by the last of its NV programs to arrive
        # here. Release: each program's reads of them (consumed above; the barrier orders the
        # other lanes' before this one) precede its increment; acquire: the last program's
        # reads and writes below follow every other program's increment.
        arrived = tl.atomic_add(counter_ptr + row_head, 1, sem="acq_rel")
        if arrived == NV - 1:  # uniform across the program
            tl.store(counter_ptr + row_head, 0)  # all NV have arrived: back to zero
            _update_qk_conv_state(x_row, stride_qkv_t, conv_row, q_ch, k_ch, cols, T, W)


def default_config(k_dim: int, v_dim: int, variant: str = "split") -> tuple[int, int]:
    """(block_v, num_warps) of the state-streaming kernel. split / onepass: 64-column V blocks
    with 4 warps (`kda_decode`'s default). fused: the whole K x V tile of a head in one program
    when it fits in registers (64 fp32 per thread at 128 x 128 with 8 warps), else 64-wide V
    blocks."""
    if variant in ("split", "onepass"):
        return split_config(k_dim, v_dim)
    block_v = v_dim if k_dim * v_dim <= 128 * 128 else min(v_dim, 64)
    return block_v, max(1, min(8, k_dim * block_v // 2048))


def kda_decode_variant(
    qkv,
    f,
    beta,
    conv_weight,
    a_log,
    dt_bias,
    conv_state,
    recurrent_state,
    slots,
    *,
    variant: str = "split",
    gate: str = "softplus",
    lower_bound: float = -5.0,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    step_states: torch.Tensor | None = None,
    step_conv: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    tuning: KdaDecodeTuning | None = None,
) -> torch.Tensor:
    """`kda_decode` in one of VARIANTS. The single-launch forms take `tuning`'s block_v,
    num_warps, state_eviction and use_pdl (None: their own `default_config`), and onepass the
    [B, H] int32 zero `counters` (allocated when None); they use no scratch."""
    args = (qkv, f, beta, conv_weight, a_log, dt_bias, conv_state, recurrent_state, slots)
    kw = dict(
        gate=gate,
        lower_bound=lower_bound,
        scale=scale,
        out=out,
        step_states=step_states,
        step_conv=step_conv,
        counters=counters,
        tuning=tuning,
    )
    if variant == "split":
        return kda_decode(*args, scratch=scratch, **kw)
    if variant not in VARIANTS:
        raise ValueError(f"unknown KDA decode variant {variant!r} ({', '.join(VARIANTS)})")
    check_gate_form(gate)
    check_inputs(
        qkv, f, beta, conv_weight, conv_state, recurrent_state, slots, a_log, dt_bias,
        step_states, step_conv,
    )  # fmt: skip
    tuning = tuning or KdaDecodeTuning()
    batch, steps, _ = qkv.shape
    _, heads, k_dim, v_dim = recurrent_state.shape
    width = conv_weight.shape[1]
    default_bv, default_warps = default_config(k_dim, v_dim, variant)
    block_v = tuning.block_v or default_bv
    num_warps = tuning.num_warps or default_warps
    if block_v > v_dim:
        raise ValueError(f"block_v={block_v} must be at most V={v_dim}")
    if out is None:
        out = qkv.new_empty(batch, steps, heads, v_dim)
    if variant == "onepass" and v_dim > block_v:
        if counters is None:
            counters = torch.zeros(batch, heads, dtype=torch.int32, device=qkv.device)
        elif counters.shape != (batch, heads) or counters.dtype != torch.int32:
            raise ValueError(f"counters must be contiguous int32 [{batch}, {heads}] (zeros)")
    elif variant == "onepass":
        # One V block per head needs no counters, but Triton 3.6 types the unused atomic branch
        # too and fails on a None pointer (seen on the H200): hand it a real int32 tensor.
        counters = torch.zeros(1, dtype=torch.int32, device=qkv.device)
    if batch == 0:
        return out
    use_pdl = pdl_enabled(qkv) if tuning.use_pdl is None else tuning.use_pdl
    if variant == "onepass":
        kernel, grid = _kda_onepass_kernel, (batch * heads * (v_dim // block_v),)
        counter_args = (counters,)
    else:
        kernel, grid, counter_args = _kda_decode_kernel, (batch * heads,), ()
    kernel[grid](
        qkv,
        f,
        beta,
        conv_weight,
        a_log,
        dt_bias,
        conv_state,
        recurrent_state,
        slots,
        out,
        *counter_args,
        step_states,
        step_conv,
        qkv.stride(0),
        qkv.stride(1),
        f.stride(0),
        f.stride(1),
        beta.stride(0),
        beta.stride(1),
        float(k_dim**-0.5 if scale is None else scale),
        float(lower_bound),
        H=heads,
        K=k_dim,
        V=v_dim,
        T=steps,
        W=width,
        WP=triton.next_power_of_2(width - 1 + steps),
        BV=block_v,
        LOWER_BOUND=gate == "lower_bound",
        STORE_STEPS=step_states is not None,
        USE_PDL=use_pdl,
        EVICT_LOAD=tuning.state_eviction[0],
        EVICT_STORE=tuning.state_eviction[1],
        num_warps=num_warps,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return out


def with_config(tuning: KdaDecodeTuning | None, **knobs) -> KdaDecodeTuning:
    """`tuning` (default: the measured defaults) with some knobs replaced."""
    return attrs.evolve(tuning or KdaDecodeTuning(), **knobs)
