"""Fused KDA decode / verify: one launch does a whole KDA layer step for 1-4 new tokens per row.

For each request row b (slot s = slots[b]) and head h, one program:

    conv update of the q/k/v channels from conv_state[s] (in place) and SiLU,
    q, k L2-normalised per head (q also scaled by `scale`), the decay gate g from the raw f,
    beta = sigmoid(raw beta), then per token t:
        S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
    with the fp32 state S = recurrent_state[s, h] read once and written back once.

Why one program per (row, head) rather than splitting V across programs: the q/k conv window of
a head is read by every V block and must be shifted in place afterwards. With V split over
several programs, whichever one writes the new window could run before another has read the old
one (CUDA gives no order between programs of a grid). One program reads the window once into
registers, walks its K x BV state tiles, and writes the window back after a barrier. At K3 dims
there are B * 96 programs, enough to fill the GPU from a handful of requests up.

Math and results are those of the torch references (`causal_conv_update`, `l2_norm`, `kda_gate`,
`kda_recurrent`), computed in fp32 throughout (the references round the conv output to the
activation dtype; this kernel does not).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

GATE_FORMS = ("softplus", "lower_bound")


def pdl_enabled(t: torch.Tensor) -> bool:
    """Programmatic dependent launch: CUDA tensors on Hopper or later, never in the interpreter."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


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
def _store_window(conv_row, window, ch, cols, first, W: tl.constexpr):
    """Write window columns first .. first+W-2 as the W-1 conv-state columns of channels `ch`."""
    keep = (cols >= first) & (cols < first + W - 1)
    tl.store(
        conv_row + ch[:, None] * (W - 1) + tl.maximum(cols - first, 0)[None, :],
        window.to(conv_row.dtype.element_ty),
        mask=keep[None, :],
    )


@triton.jit
def _l2norm(x):
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-6)


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
    q_win = _conv_window(x_row, stride_qkv_t, conv_row, q_ch, cols, T, W)
    k_win = _conv_window(x_row, stride_qkv_t, conv_row, k_ch, cols, T, W)
    a_log = tl.load(a_log_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head * K + ok).to(tl.float32)
    f_row = f_ptr + row * stride_f_b + head * K + ok
    beta_row = beta_ptr + row * stride_beta_b + head
    state_head = state_ptr + (slot * H + head) * K * V
    out_row = out_ptr + (row * T * H + head) * V

    # The first V block's state tile and v window; each iteration prefetches the next block's
    # before computing its own, so a program always has a tile load in flight.
    s = tl.load(state_head + ok[:, None] * V + tl.arange(0, BV)[None, :],
                eviction_policy="evict_first")  # [K, BV] fp32, read once per step
    v_win = _conv_window(x_row, stride_qkv_t, conv_row, 2 * H * K + head * V + tl.arange(0, BV),
                         cols, T, W)
    for v0 in range(0, V, BV):
        ov = v0 + tl.arange(0, BV)
        v_ch = 2 * H * K + head * V + ov
        tile = ok[:, None] * V + ov[None, :]
        if BV < V:
            more = ov + BV < V
            s_next = tl.load(state_head + tile + BV, mask=more[None, :], other=0.0,
                             eviction_policy="evict_first")
            # past the last block: re-read the last window (cached) rather than run off the end
            v_win_next = _conv_window(x_row, stride_qkv_t, conv_row,
                                      tl.where(more, v_ch + BV, v_ch), cols, T, W)
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
                step_conv = step_conv_ptr + (row * T + t) * C * (W - 1)
                _store_window(step_conv, v_win, v_ch, cols, t + 1, W)
        tl.store(state_head + tile, s)
        # All lanes must have read the old window before any lane overwrites it.
        tl.debug_barrier()
        _store_window(conv_row, v_win, v_ch, cols, T, W)
        if BV < V:
            s = s_next
            v_win = v_win_next

    if STORE_STEPS:
        for t in tl.static_range(T):
            step_conv = step_conv_ptr + (row * T + t) * C * (W - 1)
            _store_window(step_conv, q_win, q_ch, cols, t + 1, W)
            _store_window(step_conv, k_win, k_ch, cols, t + 1, W)
    tl.debug_barrier()
    _store_window(conv_row, q_win, q_ch, cols, T, W)
    _store_window(conv_row, k_win, k_ch, cols, T, W)


def default_config(k_dim: int, v_dim: int) -> tuple[int, int]:
    """(block_v, num_warps): the whole K x V tile of a head in one program when it fits in
    registers (64 fp32 per thread at 128 x 128 with 8 warps), else 64-wide V blocks."""
    block_v = v_dim if k_dim * v_dim <= 128 * 128 else min(v_dim, 64)
    num_warps = max(1, min(8, k_dim * block_v // 2048))
    return block_v, num_warps


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kda_decode(
    qkv: torch.Tensor,
    f: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    slots: torch.Tensor,
    *,
    gate: str = "softplus",
    lower_bound: float = -5.0,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    step_states: torch.Tensor | None = None,
    step_conv: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    use_pdl: bool | None = None,
) -> torch.Tensor:
    """One decode / verify step of a KDA layer for B rows of T new tokens each, in one launch.

    qkv: [B, T, 2*H*K + H*V] pre-conv q|k|v projections (model dtype);
    f: [B, T, H*K] raw gate (f_b(f_a(x)), before dt_bias); beta: [B, T, H] raw (before sigmoid);
    conv_weight: [C, W] depthwise taps of the stacked q|k|v channels; a_log: [H]; dt_bias: [H*K];
    conv_state: [S, C, W-1] pool (last W-1 inputs, oldest first); recurrent_state: [S, H, K, V]
    fp32 pool; slots: [B] int32/int64 slot of each row (padding rows may share a sink slot, whose
    contents then become garbage); gate: "softplus" or "lower_bound"; scale: q scale (K^-1/2).
    step_states [B, T, H, K, V] fp32 and step_conv [B, T, C, W-1] (both or neither): also keep
    the state after every token, for `kda_decode_rollback`.
    Returns o: [B, T, H, V] in qkv's dtype (or `out`). Both pools are updated in place.

    Preconditions: the last dim of qkv, f and beta is contiguous (rows may be strided views);
    pools, weights, out and the step buffers are contiguous; K, V and block_v are powers of two;
    no two real rows share a slot. No host sync: safe inside CUDA graphs.
    """
    if gate not in GATE_FORMS:
        raise ValueError(f"unknown KDA gate form {gate!r} (softplus or lower_bound)")
    batch, steps, channels = qkv.shape
    _, heads, k_dim, v_dim = recurrent_state.shape
    width = conv_weight.shape[1]
    if channels != heads * (2 * k_dim + v_dim) or conv_weight.shape[0] != channels:
        raise ValueError(
            f"qkv has {channels} channels and conv_weight {conv_weight.shape[0]}; "
            f"H={heads}, K={k_dim}, V={v_dim} need {heads * (2 * k_dim + v_dim)}"
        )
    if f.shape != (batch, steps, heads * k_dim) or beta.shape != (batch, steps, heads):
        raise ValueError(f"f {tuple(f.shape)} / beta {tuple(beta.shape)} do not match B, T, H, K")
    if conv_state.shape[1:] != (channels, width - 1) or width < 2:
        raise ValueError(
            f"conv_state {tuple(conv_state.shape)} is not [S, {channels}, {width - 1}]"
        )
    if recurrent_state.dtype != torch.float32:
        raise ValueError(f"recurrent_state must be fp32, got {recurrent_state.dtype}")
    if slots.shape != (batch,):
        raise ValueError(f"slots {tuple(slots.shape)} is not [{batch}]")
    if qkv.stride(2) != 1 or f.stride(2) != 1 or beta.stride(2) != 1:
        raise ValueError("qkv, f and beta need a contiguous last dim")
    for name, t in (("conv_state", conv_state), ("recurrent_state", recurrent_state),
                    ("conv_weight", conv_weight), ("a_log", a_log), ("dt_bias", dt_bias),
                    ("slots", slots)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if (step_states is None) != (step_conv is None):
        raise ValueError("pass both step_states and step_conv, or neither")
    if step_states is not None and (
        step_states.shape != (batch, steps, heads, k_dim, v_dim)
        or step_conv.shape != (batch, steps, channels, width - 1)
        or step_states.dtype != torch.float32
        or not (step_states.is_contiguous() and step_conv.is_contiguous())
    ):
        raise ValueError("step_states / step_conv must be contiguous [B, T, H, K, V] fp32 and "
                         "[B, T, C, W-1]")
    default_bv, default_warps = default_config(k_dim, v_dim)
    block_v = block_v or default_bv
    num_warps = num_warps or default_warps
    if not (_is_pow2(k_dim) and _is_pow2(v_dim) and _is_pow2(block_v) and block_v <= v_dim):
        raise ValueError(
            f"K={k_dim}, V={v_dim}, block_v={block_v} must be powers of two, block_v <= V"
        )
    if out is None:
        out = qkv.new_empty(batch, steps, heads, v_dim)
    elif out.shape != (batch, steps, heads, v_dim) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{batch}, {steps}, {heads}, {v_dim}]")
    if batch == 0:
        return out
    if use_pdl is None:
        use_pdl = pdl_enabled(qkv)
    launch = {"launch_pdl": True} if use_pdl else {}
    _kda_decode_kernel[(batch * heads,)](
        qkv, f, beta, conv_weight, a_log, dt_bias, conv_state, recurrent_state, slots, out,
        step_states, step_conv,
        qkv.stride(0), qkv.stride(1), f.stride(0), f.stride(1), beta.stride(0), beta.stride(1),
        float(k_dim**-0.5 if scale is None else scale), float(lower_bound),
        H=heads, K=k_dim, V=v_dim, T=steps, W=width,
        WP=triton.next_power_of_2(width - 1 + steps), BV=block_v,
        LOWER_BOUND=gate == "lower_bound", STORE_STEPS=step_states is not None, USE_PDL=use_pdl,
        num_warps=num_warps, **launch,
    )
    return out


def kda_decode_rollback(
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    slots: torch.Tensor,
    step_conv: torch.Tensor,
    step_states: torch.Tensor,
    accepted: torch.Tensor,
) -> None:
    """After a verify step run with step buffers, keep only the first accepted[b] tokens of each
    row: copy the states after token accepted[b] - 1 into the row's slots.

    conv_state: [S, C, W-1]; recurrent_state: [S, H, K, V]; slots: [B]; step_conv:
    [B, T, C, W-1]; step_states: [B, T, H, K, V]; accepted: [B] integers in 1..T (a row with
    accepted == T is rewritten with the values it already has). Graph-safe (no host sync).
    """
    rows = torch.arange(slots.shape[0], device=slots.device)
    last = (accepted.to(torch.long) - 1).clamp(0, step_states.shape[1] - 1)
    index = slots.to(torch.long)
    recurrent_state.index_copy_(0, index, step_states[rows, last])
    conv_state.index_copy_(0, index, step_conv[rows, last].to(conv_state.dtype))
