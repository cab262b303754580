"""Kimi Delta Attention layer over a packed batch with explicit per-request state."""

from __future__ import annotations

import torch
from torch import nn

from ..batch import ForwardBatch
from ..config import KdaConfig
from ..ops import dispatch
from ..ops.conv import causal_conv, causal_conv_update
from ..ops.kda import kda_chunked, kda_gate, kda_recurrent
from ..ops.norm import l2_norm
from ..state import KdaState, PagedKda
from .fp8_linear import Fp8Linear
from .norm import GatedRMSNorm

# Requests with at most this many new tokens (decode, verify) take the recurrent form; longer
# ones (prefill, extend) take the chunked form. Both give the same results.
RECURRENT_MAX_TOKENS = 4


class KdaAttention(nn.Module):
    """q/k/v projections, short conv + SiLU, L2-normalised q/k, the decay gate and beta, the
    delta-rule recurrence, a gated per-head RMSNorm and the output projection.

    forward(x [T, D], batch, state) -> (out [T, D], new state). An explicit `KdaState` is not
    modified (a new one is returned); a `PagedKda` is updated in place and returned.
    """

    def __init__(self, hidden: int, config: KdaConfig, eps: float):
        super().__init__()
        self.config = config
        proj, dim, heads = config.projection_size, config.head_dim, config.num_heads
        self.q_proj = nn.Linear(hidden, proj, bias=False)
        self.k_proj = nn.Linear(hidden, proj, bias=False)
        self.v_proj = nn.Linear(hidden, proj, bias=False)
        # Depthwise conv taps for the stacked q|k|v channels: [3 * H * K, W].
        self.conv_weight = nn.Parameter(torch.zeros(config.conv_channels, config.conv_kernel))
        self.f_a_proj = nn.Linear(hidden, dim, bias=False)
        self.f_b_proj = nn.Linear(dim, proj, bias=False)
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.dt_bias = nn.Parameter(torch.zeros(proj))
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        if config.full_rank_output_gate:
            self.g_proj = nn.Linear(hidden, proj, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, dim, bias=False)
            self.g_b_proj = nn.Linear(dim, proj, bias=False)
        self.o_norm = GatedRMSNorm(dim, eps)
        self.o_proj = nn.Linear(proj, hidden, bias=False)

    def _conv(self, qkv: torch.Tensor, batch: ForwardBatch, state: KdaState):
        """qkv: [T, 3P] -> (conv output [T, 3P], new conv state [B, 3P, W-1])."""
        if batch.uniform_len == 1:
            return causal_conv_update(qkv, state.conv, self.conv_weight)
        # Filled request by request (causal_conv keeps qkv's dtype): a batch of no requests
        # gives [0, 3P] and [0, 3P, W-1], where concatenating no pieces would fail.
        out = qkv.new_empty(qkv.shape)
        conv = qkv.new_empty(state.conv.shape)
        for i, seg in batch.segments():
            out[seg], conv[i] = causal_conv(qkv[seg], self.conv_weight, state.conv[i])
        return out, conv

    def _recurrence(self, q, k, v, g, beta, batch: ForwardBatch, state: KdaState):
        """q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H] -> (o [T, H, V], state [B, H, K, V])."""
        n = batch.uniform_len
        if n is not None:
            # Equal lengths: one batched call over [B, n, ...].
            def fold(x):
                return x.reshape(batch.batch_size, n, *x.shape[1:])

            kda = kda_recurrent if n <= RECURRENT_MAX_TOKENS else kda_chunked
            o, final = kda(
                fold(q), fold(k), fold(v), fold(g), fold(beta), initial_state=state.recurrent
            )
            return o.reshape(-1, *o.shape[2:]), final
        # Filled request by request (the forms return o in v's dtype and the state in fp32), so
        # that a batch of no requests gives [0, H, V] and [0, H, K, V].
        out = v.new_empty(v.shape)
        finals = torch.empty_like(state.recurrent, dtype=torch.float32)
        for i, seg in batch.segments():
            kda = kda_recurrent if batch.seq_lens[i] <= RECURRENT_MAX_TOKENS else kda_chunked
            o, final = kda(
                q[seg][None],
                k[seg][None],
                v[seg][None],
                g[seg][None],
                beta[seg][None],
                initial_state=state.recurrent[i : i + 1],
            )
            out[seg], finals[i] = o[0], final[0]
        return out, finals

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, state: KdaState | PagedKda
    ) -> tuple[torch.Tensor, KdaState | PagedKda]:
        if isinstance(state, PagedKda):
            n = batch.uniform_len
            steps = None
            if state.step_states is not None or state.step_conv is not None:
                steps = _check_steps(batch, state)
            if n is not None and n <= RECURRENT_MAX_TOKENS and dispatch.triton_kernels(x):
                return self._decode_fused(x, n, state), state
            if steps is None and dispatch.fla_prefill(x):
                return self._prefill_fla(x, batch, state), state
            # Gather the batch's slots, advance them, scatter back: static shapes, no host sync.
            slots = state.slots.long()
            current = KdaState(state.conv[slots], state.recurrent[slots])
            if steps is not None:  # a verify step: per-token states, token by token
                out, new = self._forward_steps(x, batch, current, steps)
            else:
                out, new = self._forward(x, batch, current)
            state.conv.index_copy_(0, slots, new.conv.to(state.conv.dtype))
            state.recurrent.index_copy_(0, slots, new.recurrent.to(state.recurrent.dtype))
            return out, state
        return self._forward(x, batch, state)

    def _decode_fused(self, x: torch.Tensor, n: int, state: PagedKda) -> torch.Tensor:
        """Decode / verify of n tokens per row in one kernel over the slot pools (in place)."""
        c = self.config
        tokens = x.shape[0]
        rows = tokens // n
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        o = dispatch.kda_decode(
            qkv.view(rows, n, -1),
            self.f_b_proj(self.f_a_proj(x)).view(rows, n, -1),
            self.b_proj(x).view(rows, n, -1),
            self.conv_weight,
            self.A_log,
            self.dt_bias,
            state.conv,
            state.recurrent,
            state.slots,
            gate=c.gate,
            lower_bound=c.gate_lower_bound,
            **(
                {}
                if state.step_states is None
                else {"step_states": state.step_states, "step_conv": state.step_conv}
            ),
        )
        return self._tail(x, o.view(tokens, c.num_heads, c.head_dim))

    def _prefill_fla(self, x: torch.Tensor, batch: ForwardBatch, state: PagedKda) -> torch.Tensor:
        """Prefill / extend: fla's varlen conv and chunked KDA over the packed batch, each
        starting from and ending in the slots."""
        c = self.config
        tokens = x.shape[0]
        slots = state.slots.long()
        cu_host = batch.cu_seqlens_host  # lengths for fla without reading the device
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = dispatch.kda_conv_prefill(
            qkv, self.conv_weight, state.conv, slots, batch.cu_seqlens, cu_seqlens_cpu=cu_host
        )
        q, k, v = (t.reshape(tokens, c.num_heads, c.head_dim) for t in mixed.chunk(3, dim=-1))
        o = dispatch.kda_prefill(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            self.f_b_proj(self.f_a_proj(x)).contiguous(),
            self.b_proj(x).contiguous(),
            self.A_log,
            self.dt_bias,
            state.recurrent,
            slots,
            batch.cu_seqlens,
            gate=c.gate,
            lower_bound=c.gate_lower_bound,
            cu_seqlens_cpu=cu_host,
        )
        return self._tail(x, o)

    def _tail(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o [T, H, V] -> gated per-head RMSNorm -> o_proj -> [T, D]."""
        c = self.config
        gate = self.g_proj(x) if c.full_rank_output_gate else self.g_b_proj(self.g_a_proj(x))
        if isinstance(self.o_proj, Fp8Linear):
            # An FP8 o_proj takes the Triton tail's e4m3 rows and per-token scales as they are
            # (no second quantisation); the reference tail otherwise.
            fused = dispatch.kda_output_tail_fp8(
                o, gate.view(o.shape), self.o_norm.weight, self.o_norm.eps
            )
            if fused is not None:
                return self.o_proj.forward_quantized(*fused, out_dtype=x.dtype)
        y = dispatch.kda_output_tail(o, gate.view(o.shape), self.o_norm.weight, self.o_norm.eps)
        return self.o_proj(y)

    def _forward(
        self, x: torch.Tensor, batch: ForwardBatch, state: KdaState
    ) -> tuple[torch.Tensor, KdaState]:
        c = self.config
        tokens = x.shape[0]
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed, conv_state = self._conv(qkv, batch, state)
        q, k, v = (t.reshape(tokens, c.num_heads, c.head_dim) for t in mixed.chunk(3, dim=-1))
        q, k = l2_norm(q), l2_norm(k)
        f = self.f_b_proj(self.f_a_proj(x)).reshape(tokens, c.num_heads, c.head_dim)
        g = kda_gate(f, self.A_log, self.dt_bias, c.gate, c.gate_lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        o, recurrent = self._recurrence(q, k, v, g, beta, batch, state)
        return self._tail(x, o), KdaState(conv_state, recurrent)

    def _forward_steps(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        state: KdaState,
        steps: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, KdaState]:
        """`_forward` of a verify step (at most RECURRENT_MAX_TOKENS new tokens per row) that
        also writes each row's conv and recurrent state after each of its tokens into
        `steps` = (step_conv [B, T, C, W-1], step_states [B, T, H, K, V]). The recurrence runs
        token by token (the recurrent form is a loop over tokens, so the outputs and the final
        states are those of `_forward`); the conv states are windows of the inputs."""
        c = self.config
        step_conv, step_states = steps
        tokens = x.shape[0]
        width = self.conv_weight.shape[1]
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = qkv.new_empty(qkv.shape)
        conv = qkv.new_empty(state.conv.shape)
        for i, seg in batch.segments():
            if seg.stop - seg.start == 1:  # as a decode step computes it
                y, new = causal_conv_update(qkv[seg], state.conv[i : i + 1], self.conv_weight)
                mixed[seg], conv[i] = y, new[0]
            else:
                mixed[seg], conv[i] = causal_conv(qkv[seg], self.conv_weight, state.conv[i])
            window = torch.cat([state.conv[i].to(qkv.dtype), qkv[seg].t()], dim=1)
            for t in range(seg.stop - seg.start):
                step_conv[i, t] = window[:, t + 1 : t + width].to(step_conv.dtype)
        q, k, v = (t.reshape(tokens, c.num_heads, c.head_dim) for t in mixed.chunk(3, dim=-1))
        q, k = l2_norm(q), l2_norm(k)
        f = self.f_b_proj(self.f_a_proj(x)).reshape(tokens, c.num_heads, c.head_dim)
        g = kda_gate(f, self.A_log, self.dt_bias, c.gate, c.gate_lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        out = v.new_empty(v.shape)
        finals = torch.empty_like(state.recurrent, dtype=torch.float32)
        for i, seg in batch.segments():
            current = state.recurrent[i : i + 1]
            for t in range(seg.stop - seg.start):
                at = slice(seg.start + t, seg.start + t + 1)
                o, current = kda_recurrent(
                    q[at][None], k[at][None], v[at][None], g[at][None], beta[at][None],
                    initial_state=current,
                )  # fmt: skip
                out[at] = o[0]
                step_states[i, t] = current[0]
            finals[i] = current[0]
        return self._tail(x, out), KdaState(conv, finals)


def _check_steps(batch: ForwardBatch, state: PagedKda) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify step's per-token state buffers, checked against the batch."""
    step_conv, step_states = state.step_conv, state.step_states
    if step_conv is None or step_states is None:
        raise ValueError("pass both step_states and step_conv, or neither")
    longest = max(batch.seq_lens, default=0)
    if longest > RECURRENT_MAX_TOKENS:
        raise ValueError(
            f"per-token states are kept for at most {RECURRENT_MAX_TOKENS} new tokens per row "
            f"(a verify step), got {longest}"
        )
    rows = batch.batch_size
    if step_states.shape[0] < rows or step_states.shape[1] < longest:
        raise ValueError(
            f"step_states {tuple(step_states.shape)} cannot hold {rows} rows of {longest} tokens"
        )
    if step_conv.shape[:2] != step_states.shape[:2]:
        raise ValueError("step_conv and step_states must have the same [B, T]")
    return step_conv, step_states
