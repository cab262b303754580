"""Torch references for Kimi Delta Attention: the gate, the recurrent form and the chunked form.

Per value head the state S is K x V (fp32). One step with log-decay g_t (<= 0, per key channel),
scalar beta_t, key k_t, value v_t and query q_t (q scaled by K^-1/2):

    S <- diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

The chunked form computes the same thing a chunk at a time (see `kda_chunked`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kda_gate(
    f: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    form: str,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Per-channel log-decay g from the raw gate projection f.

    f: [..., H, K]; a_log: [H]; dt_bias: [H * K] or [H, K].
    form "softplus":    g = -exp(a_log) * softplus(f + dt_bias)
    form "lower_bound": g = lower_bound * sigmoid(exp(a_log) * (f + dt_bias))
    Returns fp32 [..., H, K], every entry <= 0.
    """
    heads, dim = f.shape[-2:]
    x = f.float() + dt_bias.float().reshape(heads, dim)
    rate = a_log.float().reshape(heads, 1).exp()
    if form == "softplus":
        return -rate * F.softplus(x)
    if form == "lower_bound":
        return lower_bound * torch.sigmoid(rate * x)
    raise ValueError(f"unknown KDA gate form {form!r} (softplus or lower_bound)")


def _inputs_fp32(q, k, v, g, beta, scale):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q.float() * scale, k.float(), v.float(), g.float(), beta.float()


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H];
    scale: query scale (default K^-1/2); initial_state: [B, H, K, V] or None (zeros).
    Returns o: [B, T, H, V] in v's dtype and the final state [B, H, K, V] in fp32.
    """
    batch, steps, heads, kdim = q.shape
    vdim, out_dtype = v.shape[-1], v.dtype
    q, k, v, g, beta = _inputs_fp32(q, k, v, g, beta, scale)
    state = q.new_zeros(batch, heads, kdim, vdim)
    if initial_state is not None:
        state = state + initial_state.float()
    out = q.new_empty(batch, steps, heads, vdim)
    for t in range(steps):
        state = state * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, state)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - predicted)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
    return out.to(out_dtype), state


def _chunk(q, k, v, g, beta, state):
    """One chunk of length C for every (batch, head): q, k, g: [B, H, C, K]; v: [B, H, C, V];
    beta: [B, H, C]; state: [B, H, K, V]. Returns o [B, H, C, V] and the state after the chunk.

    Writing Gam_t = cumsum(g)_t and S_t = diag(exp(Gam_t)) X_t turns the recurrence into
    X_t = X_{t-1} + (k_t * exp(-Gam_t)) d_t^T, d_t = beta_t (v_t - (k_t * exp(Gam_t))^T X_{t-1}).
    Stacking the d_t of the chunk gives a unit lower-triangular system (I + A) D = beta (V - Kg S0),
    A_ts = beta_t sum_c k_tc k_sc exp(Gam_tc - Gam_sc) for s < t. Decay ratios are only ever
    formed for s <= t, where they are <= 1, so nothing overflows however strong the decay.
    """
    length = q.shape[2]
    gam = g.cumsum(2)  # [B, H, C, K]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    # ratio[t, s] = exp(Gam_t - Gam_s) for s <= t, 0 above the diagonal: [B, H, C, C, K]
    diff = gam.unsqueeze(3) - gam.unsqueeze(2)
    ratio = diff.masked_fill(~causal[..., None], float("-inf")).exp()
    kk = torch.einsum("bhtc,bhsc,bhtsc->bhts", k, k, ratio)
    qk = torch.einsum("bhtc,bhsc,bhtsc->bhts", q, k, ratio)
    strictly_lower = causal & ~torch.eye(length, dtype=torch.bool, device=q.device)
    system = beta.unsqueeze(-1) * kk.masked_fill(~strictly_lower, 0.0)
    system = system + torch.eye(length, dtype=q.dtype, device=q.device)
    decayed_k = k * gam.exp()  # [B, H, C, K]
    rhs = beta.unsqueeze(-1) * (v - decayed_k @ state)  # [B, H, C, V]
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (q * gam.exp()) @ state + qk @ delta
    tail = gam[:, :, -1:]  # [B, H, 1, K]
    new_state = (
        state * tail.transpose(-1, -2).exp() + (k * (tail - gam).exp()).transpose(-1, -2) @ delta
    )
    return out, new_state


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA a chunk at a time; same contract and results as `kda_recurrent`.

    The last chunk may be shorter than chunk_size, so any T works and the state after a
    chunk boundary is exactly the recurrent state at that token.
    """
    batch, steps, heads, kdim = q.shape
    vdim, out_dtype = v.shape[-1], v.dtype
    q, k, v, g, beta = _inputs_fp32(q, k, v, g, beta, scale)
    # [B, T, H, X] -> [B, H, T, X]
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    beta = beta.transpose(1, 2)
    state = q.new_zeros(batch, heads, kdim, vdim)
    if initial_state is not None:
        state = state + initial_state.float()
    outs = []
    for start in range(0, steps, chunk_size):
        piece = slice(start, min(start + chunk_size, steps))
        out, state = _chunk(
            q[:, :, piece], k[:, :, piece], v[:, :, piece], g[:, :, piece], beta[:, :, piece], state
        )
        outs.append(out)
    out = torch.cat(outs, dim=2) if outs else q.new_empty(batch, heads, 0, vdim)
    return out.transpose(1, 2).to(out_dtype), state
