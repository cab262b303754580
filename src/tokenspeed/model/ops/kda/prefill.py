"""KDA prefill / extend over a packed varlen batch: thin adapters over fla-core that read and
write the runtime's slot pools.

- `kda_conv_prefill`: the q/k/v short conv + SiLU through fla's varlen `causal_conv1d`, one
  launch for the whole batch (the reference convolves request by request).
- `kda_prefill`: the recurrence through fla's `chunk_kda`. fla does the q/k L2 norm, the decay
  gate (both forms) and the beta sigmoid inside its kernels, so the caller hands over the raw
  projections.

Each request starts from the state in its slot and the state after its last token goes back
there; because the scheduler puts checkpoints on chunk ends, that final state is the checkpoint
and no per-token state is kept.
"""

from __future__ import annotations

import torch

from .decode import check_gate_form

# fla's bounded-gate fast path (`safe_gate`) accepts lower bounds in [-5, 0).
SAFE_GATE_RANGE = (-5.0, 0.0)


def use_safe_gate(gate: str, lower_bound: float) -> bool:
    """Whether fla's bounded-gate fast path applies: the lower-bound form with bound in [-5, 0)."""
    return gate == "lower_bound" and SAFE_GATE_RANGE[0] <= lower_bound < SAFE_GATE_RANGE[1]


def kda_conv_prefill(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv + SiLU of N packed sequences, continuing from their slots' windows.

    qkv: [T, C] inputs (the stacked q|k|v projections); weight: [C, W] (tap W-1 multiplies the
    current input); conv_state: [S, C, W-1] pool, each slot's last W-1 inputs oldest first (as
    `ops.conv.causal_conv` keeps them); slots: [N] slot of each sequence (distinct);
    cu_seqlens: [N+1] int64 on the device; cu_seqlens_cpu: the same on the host (saves fla a
    device read). Returns y: [T, C] in qkv's dtype (`causal_conv` of each sequence from its
    window); the slots hold the windows after each sequence's last input afterwards.
    """
    channels = qkv.shape[-1]
    width = weight.shape[1]
    if (
        qkv.dim() != 2
        or weight.shape[0] != channels
        or conv_state.shape[1:] != (channels, width - 1)
    ):
        raise ValueError(
            f"qkv {tuple(qkv.shape)}, weight {tuple(weight.shape)} and conv_state "
            f"{tuple(conv_state.shape)} do not describe one [T, C] conv with [C, W-1] windows"
        )
    if slots.shape != (cu_seqlens.shape[0] - 1,):
        raise ValueError(f"{slots.shape[0]} slots for {cu_seqlens.shape[0] - 1} sequences")
    from fla.modules.causal_conv1d import causal_conv1d  # optional GPU dependency

    index = slots.to(torch.long)
    # fla keeps W inputs per sequence (the oldest unused by the conv): ours with one in front.
    initial = qkv.new_zeros(index.shape[0], channels, width)
    initial[..., 1:] = conv_state.index_select(0, index)
    with torch.no_grad():
        y, final = causal_conv1d(
            qkv.unsqueeze(0),
            weight,
            initial_state=initial,
            output_final_state=True,
            activation="silu",
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
        conv_state.index_copy_(0, index, final[..., 1:].to(conv_state.dtype))
    return y[0]


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    beta: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    recurrent_state: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    gate: str = "softplus",
    lower_bound: float = -5.0,
    scale: float | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    safe_gate: bool | None = None,
) -> torch.Tensor:
    """KDA over N packed sequences of T tokens in total, continuing from their slots.

    q, k: [T, H, K] after the short conv and SiLU, before the L2 norm; v: [T, H, V];
    f: [T, H, K] (or [T, H*K]) raw gate f_b(f_a(x)), before dt_bias; beta: [T, H] raw logits;
    a_log: [H]; dt_bias: [H*K]; recurrent_state: [S, H, K, V] fp32 pool; slots: [N] slot of
    each sequence (distinct); cu_seqlens: [N+1] int64 on the device, sequence i owning tokens
    cu_seqlens[i]:cu_seqlens[i+1]; cu_seqlens_cpu: the same on the host (saves fla a device
    sync); safe_gate: fla's bounded-gate path, by default on exactly when `use_safe_gate`.
    Returns o: [T, H, V] in q's dtype; the slots of `slots` hold the final states afterwards.

    Non-contiguous q/k/v/f/beta are copied by fla; pass contiguous tensors to avoid that.
    Not graph-safe without cu_seqlens_cpu (fla reads the lengths on the host).
    """
    check_gate_form(gate)
    tokens, heads, k_dim = q.shape
    if k.shape != q.shape or v.shape[:2] != (tokens, heads) or beta.shape != (tokens, heads):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"beta {tuple(beta.shape)} do not describe one [T, H, ...] batch"
        )
    if f.numel() != tokens * heads * k_dim:
        raise ValueError(f"f {tuple(f.shape)} is not [T, H, K] = [{tokens}, {heads}, {k_dim}]")
    if recurrent_state.dtype != torch.float32 or recurrent_state.shape[1:3] != (heads, k_dim):
        raise ValueError(
            f"recurrent_state {tuple(recurrent_state.shape)} "
            f"{recurrent_state.dtype} is not an fp32 [S, {heads}, {k_dim}, V] pool"
        )
    if slots.shape != (cu_seqlens.shape[0] - 1,):
        raise ValueError(f"{slots.shape[0]} slots for {cu_seqlens.shape[0] - 1} sequences")
    from fla.ops.kda import chunk_kda  # imported late: fla is an optional GPU dependency

    if safe_gate is None:
        safe_gate = use_safe_gate(gate, lower_bound)
    index = slots.to(torch.long)
    with torch.no_grad():
        o, final = chunk_kda(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            f.reshape(1, tokens, heads, k_dim),
            beta.unsqueeze(0),
            scale=scale,
            initial_state=recurrent_state.index_select(0, index),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=safe_gate,
            lower_bound=lower_bound if gate == "lower_bound" else None,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
            A_log=a_log,
            dt_bias=dt_bias,
        )
        recurrent_state.index_copy_(0, index, final)
    return o[0]
