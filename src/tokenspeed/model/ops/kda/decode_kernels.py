"""Triton kernels of the KDA decode / verify step (`decode.kda_decode` launches them).

`decode.py` describes the math: the prep kernel and the V-blocked recurrence. The shared pieces
(conv windows and their stores, norms, the gate) come first; benchmarks/kda_decode_variants.py
builds its comparison kernels from them too.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _conv_window(x_row, stride_t, conv_row, ch, cols, T: tl.constexpr, W: tl.constexpr):
    """The conv window of channels `ch` as fp32 [N, WP]: column c < W-1 is conv-state column c
    (oldest first), column W-1+t is the input of new token t, later columns are zero."""
    from_state = cols < W - 1
    from_input = (cols >= W - 1) & (cols < W - 1 + T)
    # Offsets are clamped so that masked-off lanes still point inside the tensors.
    old = tl.load(
        conv_row + ch[:, None] * (W - 1) + tl.minimum(cols, W - 2)[None, :],
        mask=from_state[None, :],
        other=0.0,
    )
    new = tl.load(
        x_row + tl.maximum(cols - (W - 1), 0)[None, :] * stride_t + ch[:, None],
        mask=from_input[None, :],
        other=0.0,
    )
    return tl.where(from_state[None, :], old.to(tl.float32), new.to(tl.float32))


@triton.jit
def _store_window(conv_row, window, ch, cols, first, W: tl.constexpr):
    """Write window columns first .. first+W-2 as the W-1 conv-state columns of channels `ch`."""
    keep = (cols >= first) & (cols < first + W - 1)
    tl.store(
        conv_row + ch[:, None] * (W - 1) + tl.maximum(cols - first, 0)[None, :],
        window.to(conv_row.dtype.element_ty),
        mask=keep[None, :],
    )


@triton.jit
def _conv_silu_taps(x_row, stride_t, conv_row, w_ptr, ch, t: tl.constexpr, W: tl.constexpr):
    """SiLU(conv output of token t) for channels `ch` as a 1-D [N] vector, reading each window
    column straight from memory (L1-cached re-reads) instead of from a 2-D [N, WP] window, so
    that no 2-D window layout leaks into the code that consumes the result."""
    y = tl.zeros(ch.shape, dtype=tl.float32)
    for j in tl.static_range(W):
        if t + j < W - 1:  # window column t + j is conv-state column t + j
            x = tl.load(conv_row + ch * (W - 1) + (t + j)).to(tl.float32)
        else:  # ... or the input of token t + j - (W - 1)
            x = tl.load(x_row + (t + j - (W - 1)) * stride_t + ch).to(tl.float32)
        y += x * tl.load(w_ptr + ch * W + j).to(tl.float32)
    return y * tl.sigmoid(y)


@triton.jit
def _l2norm(x):
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _gate(f, a_log, dt_bias, lower_bound, LOWER_BOUND: tl.constexpr):
    """Log-decay from the raw gate: lower_bound * sigmoid(e^A (f + b)) or -e^A softplus(f + b)."""
    x = f + dt_bias
    rate = tl.exp(a_log)
    if LOWER_BOUND:
        g = lower_bound * tl.sigmoid(rate * x)
    else:
        # softplus(x) = max(x, 0) + log(1 + e^-|x|): no overflow for large x.
        g = -rate * (tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
    return g


@triton.jit
def _token_gate(
    f_row,
    beta_row,
    t,
    stride_f_t,
    stride_beta_t,
    a_log,
    dt_bias,
    lower_bound,
    LOWER_BOUND: tl.constexpr,
):
    """Token t's decay exp(g) [K] (`_gate` of its raw f) and beta (sigmoid of its raw beta)."""
    f = tl.load(f_row + t * stride_f_t).to(tl.float32)
    decay = tl.exp(_gate(f, a_log, dt_bias, lower_bound, LOWER_BOUND))
    beta = tl.sigmoid(tl.load(beta_row + t * stride_beta_t).to(tl.float32))
    return decay, beta


@triton.jit
def _qk_windows(x_row, stride_t, conv_row, q_ch, k_ch, cols, T: tl.constexpr, W: tl.constexpr):
    """The conv windows (`_conv_window`) of a head's q and k channels."""
    q_win = _conv_window(x_row, stride_t, conv_row, q_ch, cols, T, W)
    k_win = _conv_window(x_row, stride_t, conv_row, k_ch, cols, T, W)
    return q_win, k_win


@triton.jit
def _store_qk_windows(conv_row, q_win, k_win, q_ch, k_ch, cols, first, W: tl.constexpr):
    """`_store_window` of a head's q and k windows (q first)."""
    _store_window(conv_row, q_win, q_ch, cols, first, W)
    _store_window(conv_row, k_win, k_ch, cols, first, W)


@triton.jit
def _load_record(rec, ok, K: tl.constexpr):
    """A token's prep record (see `_kda_prep_kernel`): exp(g) q [K], k [K], exp(g) [K], beta,
    q.k."""
    dq = tl.load(rec + ok)
    k = tl.load(rec + K + ok)
    decay = tl.load(rec + 2 * K + ok)
    return dq, k, decay, tl.load(rec + 3 * K), tl.load(rec + 3 * K + 1)


@triton.jit
def _step_conv_row(step_conv_ptr, row, t, C: tl.constexpr, T: tl.constexpr, W: tl.constexpr):
    """The conv state after token t of `row` in the step buffer [B, T, C, W-1]."""
    return step_conv_ptr + (row * T + t) * C * (W - 1)


@triton.jit
def _store_step_windows(
    step_conv_ptr, row, window, ch, cols, C: tl.constexpr, T: tl.constexpr, W: tl.constexpr
):
    """The conv state of channels `ch` after each token t (window columns t+1 .. t+W-1) into
    `row`'s step buffer."""
    for t in tl.static_range(T):
        step_conv = _step_conv_row(step_conv_ptr, row, t, C, T, W)
        _store_window(step_conv, window, ch, cols, t + 1, W)


@triton.jit
def _kda_prep_kernel(
    qkv_ptr,  # [B, T, C] pre-conv q|k|v, C = 2*H*K + H*V
    f_ptr,  # [B, T, H*K] raw gate (before dt_bias)
    beta_ptr,  # [B, T, H] raw beta (before sigmoid)
    conv_w_ptr,  # [C, W]
    a_log_ptr,  # [H]
    dt_bias_ptr,  # [H*K]
    conv_state_ptr,  # [S, C, W-1] pool, q/k (V_IN_PREP: also v) channels updated in place
    slots_ptr,  # [B]
    scratch_ptr,  # [B, T, H, D] fp32 records, see the module docstring
    ready_ptr,  # [B, H] int32: + NV when the (row, head)'s records are written
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
    D: tl.constexpr,  # scratch record width
    NV: tl.constexpr,  # recurrence programs per (row, head): V // BV
    RELEASE: tl.constexpr,  # set the ready counters (the recurrence waits on them, OVERLAP)
    V_IN_PREP: tl.constexpr,  # also the v conv: v goes into the record at VOFF
    VOFF: tl.constexpr,
    LOWER_BOUND: tl.constexpr,
    STORE_STEPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVICT_RECORD: tl.constexpr,  # cache eviction policy of the record stores
):
    """Prep of the split variant, one program per (row, head): the head's q/k conv (its conv
    state updated by this program only), norms, gate and beta (V_IN_PREP: also the v conv of
    the head's V channels), as one record per token; then it adds NV to the (row, head)'s ready
    counter, one for each recurrence program that waits on it."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // H
    head = pid % H
    C = 2 * H * K + H * V
    ok = tl.arange(0, K)
    cols = tl.arange(0, WP)
    q_ch = head * K + ok
    k_ch = H * K + head * K + ok
    v_ch = 2 * H * K + head * V + tl.arange(0, V)

    if USE_PDL:
        # Wait for the previous kernels (projections, pools) before anything else, and only
        # then let the recurrence launch: it reads the pools before its own wait, which is safe
        # only because every program of this grid has passed this wait by then.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    slot = tl.load(slots_ptr + row).to(tl.int64)
    x_row = qkv_ptr + row * stride_qkv_b
    conv_row = conv_state_ptr + slot * C * (W - 1)
    a_log = tl.load(a_log_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head * K + ok).to(tl.float32)
    f_row = f_ptr + row * stride_f_b + head * K + ok
    beta_row = beta_ptr + row * stride_beta_b + head

    for t in tl.static_range(T):
        q = _l2norm(_conv_silu_taps(x_row, stride_qkv_t, conv_row, conv_w_ptr, q_ch, t, W))
        q = q * scale
        k = _l2norm(_conv_silu_taps(x_row, stride_qkv_t, conv_row, conv_w_ptr, k_ch, t, W))
        decay, beta = _token_gate(
            f_row, beta_row, t, stride_f_t, stride_beta_t, a_log, dt_bias, lower_bound, LOWER_BOUND
        )
        rec = scratch_ptr + ((row * T + t) * H + head) * D
        tl.store(rec + ok, decay * q, eviction_policy=EVICT_RECORD)
        tl.store(rec + K + ok, k, eviction_policy=EVICT_RECORD)
        tl.store(rec + 2 * K + ok, decay, eviction_policy=EVICT_RECORD)
        tl.store(rec + 3 * K, beta, eviction_policy=EVICT_RECORD)
        tl.store(rec + 3 * K + 1, tl.sum(q * k, axis=0), eviction_policy=EVICT_RECORD)
        if V_IN_PREP:
            v = _conv_silu_taps(x_row, stride_qkv_t, conv_row, conv_w_ptr, v_ch, t, W)
            tl.store(rec + VOFF + tl.arange(0, V), v, eviction_policy=EVICT_RECORD)

    # The q/k conv state update (and the per-token windows), from [K, WP] windows loaded now.
    q_win, k_win = _qk_windows(x_row, stride_qkv_t, conv_row, q_ch, k_ch, cols, T, W)
    if V_IN_PREP:
        v_win = _conv_window(x_row, stride_qkv_t, conv_row, v_ch, cols, T, W)
    if STORE_STEPS:
        for t in tl.static_range(T):
            step_conv = _step_conv_row(step_conv_ptr, row, t, C, T, W)
            _store_qk_windows(step_conv, q_win, k_win, q_ch, k_ch, cols, t + 1, W)
            if V_IN_PREP:
                _store_window(step_conv, v_win, v_ch, cols, t + 1, W)
    # All lanes must have read the old window before any lane overwrites it. No other program
    # touches these channels of this slot (padding rows sharing the sink slot aside).
    tl.debug_barrier()
    _store_qk_windows(conv_row, q_win, k_win, q_ch, k_ch, cols, T, W)
    if V_IN_PREP:
        _store_window(conv_row, v_win, v_ch, cols, T, W)
    # Release, after every lane's stores (the barrier): the records and the conv state are
    # visible to whoever acquires the counter. Last, so that the recurrence (and through it
    # every later kernel) never runs ahead of any memory work of this program. Only when the
    # recurrence waits on the counters: with the grid wait they stay untouched (zero).
    if RELEASE:
        tl.debug_barrier()
        tl.atomic_add(ready_ptr + pid, NV, sem="release")


@triton.jit
def _kda_recurrent_kernel(
    qkv_ptr,  # [B, T, C] pre-conv q|k|v (this kernel reads the v channels)
    conv_w_ptr,  # [C, W]
    conv_state_ptr,  # [S, C, W-1] pool, v channels updated in place
    scratch_ptr,  # [B, T, H, D] fp32 records written by the prep kernel
    ready_ptr,  # [B, H] int32 ready counters of the prep kernel (zero again after this grid)
    state_ptr,  # [S, H, K, V] fp32 pool, updated in place
    slots_ptr,  # [B]
    out_ptr,  # [B, T, H, V]
    step_state_ptr,  # [B, T, H, K, V] fp32 or None
    step_conv_ptr,  # [B, T, C, W-1] or None
    stride_qkv_b,
    stride_qkv_t,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    T: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    OVERLAP: tl.constexpr,  # wait for the head's ready counter, not for the prep grid
    V_IN_PREP: tl.constexpr,  # v comes conv'd from the record at VOFF (the prep did its conv)
    VOFF: tl.constexpr,
    STORE_STEPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    EVICT_LOAD: tl.constexpr,  # cache eviction policy of the state tile's load
    EVICT_STORE: tl.constexpr,  # ... and of its store
):
    """Recurrence of the split variant, one program per (row, head, V block), which also does
    the conv of its own BV v channels. The V blocks of a head are adjacent program ids, so they
    run together and share the head's records in L2.

    With OVERLAP it waits for its own (row, head)'s records only (the ready counter), not for
    the whole prep grid (a PDL wait), so that it overlaps the prep kernel instead of following
    it. Spinning is safe: under PDL this grid launches only once every prep program has passed
    its `gdc_launch_dependents`, i.e. is resident or done, so every counter is set without
    needing an SM a spinning program holds; without PDL the prep grid has finished before."""
    pid = tl.program_id(0).to(tl.int64)
    NV = V // BV  # constexpr
    vb = pid % NV
    row = pid // NV // H
    head = pid // NV % H
    C = 2 * H * K + H * V
    ok = tl.arange(0, K)
    ov = vb * BV + tl.arange(0, BV)
    cols = tl.arange(0, WP)
    v_ch = 2 * H * K + head * V + ov
    tile = ok[:, None] * V + ov[None, :]

    # The slot index and the state tile are read before any wait, overlapping the load with the
    # prep kernel. Safe: the prep kernel writes neither, and this grid launches only after
    # every prep program has passed its own wait, i.e. after every earlier kernel (the
    # previous step's recurrence, a rollback, a prefill, the projections) has completed.
    slot = tl.load(slots_ptr + row).to(tl.int64)
    state_tile = state_ptr + (slot * H + head) * K * V + tile
    s = tl.load(state_tile, eviction_policy=EVICT_LOAD)  # [K, BV] fp32, touched once
    x_row = qkv_ptr + row * stride_qkv_b
    conv_row = conv_state_ptr + slot * C * (W - 1)

    # Acquire this (row, head)'s records and count this program off (OVERLAP: the counter is
    # back to zero once all NV programs of the head have passed), or wait for the whole prep
    # grid (the counters untouched: a scalar atomic costs each program a barrier and a round
    # trip, which verify steps measured). With OVERLAP the conv window of the block's v
    # channels is also loaded now
    # and rewritten before the tile's store, so that the program ends with that store (the
    # form timed with it; the grid wait keeps the window after the store, as timed with it).
    ready = ready_ptr + row * H + head
    if OVERLAP:
        if not V_IN_PREP:
            v_win = _conv_window(x_row, stride_qkv_t, conv_row, v_ch, cols, T, W)
            if T == 1:
                # The v conv reads nothing the prep writes: done before the wait, it is off the
                # path from the ready counter to the math.
                v_early = _conv_silu_taps(x_row, stride_qkv_t, conv_row, conv_w_ptr, v_ch, 0, W)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        while tl.atomic_add(ready, 0, sem="acquire") == 0:
            pass
        tl.atomic_add(ready, -1, sem="relaxed")
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()  # the records of the prep kernel
        tl.extra.cuda.gdc_launch_dependents()

    for t in tl.static_range(T):
        rec = scratch_ptr + ((row * T + t) * H + head) * D
        dq, k, decay, beta, qk = _load_record(rec, ok, K)
        if V_IN_PREP:
            v = tl.load(rec + VOFF + ov)
        elif OVERLAP and T == 1:
            v = v_early
        else:
            v = _conv_silu_taps(x_row, stride_qkv_t, conv_row, conv_w_ptr, v_ch, t, W)
        # Both reductions read the old tile: S_new = diag(d) S + k delta^T gives
        # S_new^T q = S^T (d q) + (q.k) delta, and (diag(d) S)^T k = S^T (d k). One two-operand
        # reduction: one pass through shared memory for both.
        u, w = tl.reduce((s * (decay * k)[:, None], s * dq[:, None]), 0, _add_pairs)
        delta = beta * (v - u)
        s = s * decay[:, None] + k[:, None] * delta[None, :]
        o = w + qk * delta
        tl.store(out_ptr + ((row * T + t) * H + head) * V + ov, o.to(out_ptr.dtype.element_ty))
        if STORE_STEPS:
            tl.store(step_state_ptr + ((row * T + t) * H + head) * K * V + tile, s)
    if V_IN_PREP:  # the prep kernel has also updated the v channels' conv state
        tl.store(state_tile, s, eviction_policy=EVICT_STORE)
    else:
        if not OVERLAP:
            tl.store(state_tile, s, eviction_policy=EVICT_STORE)
            v_win = _conv_window(x_row, stride_qkv_t, conv_row, v_ch, cols, T, W)
        # The conv state of this block's own v channels (no other program touches them).
        if STORE_STEPS:
            _store_step_windows(step_conv_ptr, row, v_win, v_ch, cols, C, T, W)
        tl.debug_barrier()  # all lanes have read the old window before any lane overwrites it
        _store_window(conv_row, v_win, v_ch, cols, T, W)
        if OVERLAP:
            tl.store(state_tile, s, eviction_policy=EVICT_STORE)
