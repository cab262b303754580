"""KDA decode / verify: a whole KDA layer step for 1-4 new tokens per row, over the slot pools.

Per request row b (slot s = slots[b]) and head h:

    conv update of the q/k/v channels from conv_state[s] (in place) and SiLU,
    q, k L2-normalised per head (q also scaled by `scale`), the decay gate g from the raw f,
    beta = sigmoid(raw beta), then per token t:
        S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t
    with the fp32 state S = recurrent_state[s, h] read once and written back once.

The step is bandwidth-bound: at K3 dims the fp32 state is 6 MiB per request per layer, read and
written once; everything else is a few percent of that. Two launches chained with
programmatic dependent launch (PDL):
  1. prep, one program per (row, head): the q/k conv update (the conv state of the head's q/k
     channels is read and rewritten by that program only, so exactly once), SiLU, the norms,
     the gate and beta; per token it writes one fp32 record of `scratch` [B, T, H, D]:
        dq = exp(g) * q (scaled) [K] | k [K] | exp(g) [K] | beta | q.k | padding
     and then, at one token per row, releases the (row, head)'s ready counter (`counters`
     [B, H]).
  2. recurrence, one program per (row, head, V block of BV columns): loads its K x BV state tile
     (at once: the prep kernel does not write the state pool, see `_kda_recurrent_kernel`),
     waits, at one token per row, for its own (row, head)'s ready counter rather than for the
     whole prep grid, so that the two kernels overlap (verify steps wait for the grid: faster
     there); does the conv of its own BV v channels (their conv state is
     touched by that program only; for verify steps the prep does the v conv instead and
     writes v into the record, `v_in_prep`, which measured ~10% faster there), then per token
        u = S^T (exp(g) * k),  w = S^T (exp(g) * q),  delta = beta (v - u),
        o = w + (q.k) delta,   S <- diag(exp(g)) S + k delta^T
     (the same step, rearranged so that both reductions read the old tile and o does not wait
     for the update), and writes the tile back. Many small independent programs (B * H * V / BV)
     keep many state loads in flight per SM, which is what streaming at copy speed needs.
     The tile is loaded with L2 priority evict-last and stored with no hint (`state_eviction`):
     on the H200 the recurrence then runs 3-6% faster than with evict-first on both (the form
     before) and ~1% faster than with no hints (measured 2026-12-03; docs/perf/kda.md). The
     plain store is meant to leave the rewritten lines at normal priority, so that stale tiles
     do not crowd out later kernels' data. At one token the v conv is computed before the wait,
     since it reads nothing the prep writes.

Two single-launch forms measured against this one ("onepass": the prep folded into every V
block's program; "fused": one program per head, the first design, at ~37% of copy bandwidth)
live beside the benchmark that compares them (benchmarks/kda_decode_variants.py).

Math and results are those of the torch references (`causal_conv_update`, `l2_norm`, `kda_gate`,
`kda_recurrent`), computed in fp32 throughout (the references round the conv output to the
activation dtype; these kernels do not). The Triton kernels themselves are in `decode_kernels.py`;
this module checks the arguments and launches them.
"""

from __future__ import annotations

import attrs
import torch
import triton

from ..interpret import interpreting
from ..moe._launch import EVICTION_POLICIES
from ..tuning import boolean, integer, is_pow2, one_of, pair_of, tuning_or_default, warp_count
from .decode_kernels import _kda_prep_kernel, _kda_recurrent_kernel

GATE_FORMS = ("softplus", "lower_bound")


def check_gate_form(gate: str) -> None:
    """Refuse a gate form not in GATE_FORMS (the decode and the prefill entry points alike)."""
    if gate not in GATE_FORMS:
        raise ValueError(f"unknown KDA gate form {gate!r} (softplus or lower_bound)")


def pdl_enabled(t: torch.Tensor) -> bool:
    """Programmatic dependent launch: CUDA tensors on Hopper or later, never in the interpreter."""
    if not t.is_cuda or interpreting():
        return False
    return torch.cuda.get_device_capability(t.device)[0] >= 9


@attrs.frozen(kw_only=True)
class KdaDecodeTuning:
    """The tuning knobs of `kda_decode`; the defaults are the measured ones (H200,
    docs/perf/kda.md). None means "by shape", resolved by `resolve`. None of them changes the
    result.

    block_v: V columns of the state tile per recurrence program (None: 64, at most V);
    num_warps: the recurrence kernel's warps (None: 4, fewer for tiles under 4096 values);
    prep_warps: the prep kernel's warps (2);
    overlap_prep: the recurrence waits for its own (row, head)'s ready counter (True) or for the
    whole prep grid (False); None: True at one token per row, False for verify steps;
    v_in_prep: the prep also does the v conv and hands v over in the record; None: for verify
    steps only (`resolve_v_in_prep`);
    state_eviction: Triton `eviction_policy` of the state tiles' (load, store): evict-last
    loads and plain stores ("" is no hint); record_eviction: that of the prep's record stores;
    use_pdl: chain the two launches with programmatic dependent launch (None: `pdl_enabled`).
    """

    block_v: int | None = attrs.field(default=None, validator=integer(pow2=True))
    num_warps: int | None = attrs.field(default=None, validator=warp_count())
    prep_warps: int = attrs.field(default=2, validator=warp_count())
    overlap_prep: bool | None = attrs.field(default=None, validator=boolean())
    v_in_prep: bool | None = attrs.field(default=None, validator=boolean())
    state_eviction: tuple[str, str] = attrs.field(
        default=("evict_last", ""), validator=pair_of(EVICTION_POLICIES)
    )
    record_eviction: str = attrs.field(default="", validator=one_of(EVICTION_POLICIES))
    use_pdl: bool | None = attrs.field(default=None, validator=boolean())

    def resolve(self, k_dim: int, v_dim: int, steps: int) -> KdaDecodeTuning:
        """These knobs with every by-shape default (all but use_pdl, which depends on the
        device) filled in for K, V and T tokens per row: what `kda_decode` launches with."""
        default_bv, default_warps = default_config(k_dim, v_dim)
        return attrs.evolve(
            self,
            block_v=self.block_v or default_bv,
            num_warps=self.num_warps or default_warps,
            overlap_prep=steps == 1 if self.overlap_prep is None else self.overlap_prep,
            v_in_prep=resolve_v_in_prep(self.v_in_prep, steps),
        )


def default_config(k_dim: int, v_dim: int) -> tuple[int, int]:
    """(block_v, num_warps) of the recurrence kernel: 64-column V blocks with 4 warps (a 32 KiB
    tile, 64 fp32 per thread): the fastest of the H200 sweep at 128 requests (465 us, 82% of
    copy bandwidth, vs 489 us / 77% for 32 x 4; docs/perf/kda.md)."""
    block_v = min(v_dim, 64)
    return block_v, max(1, min(4, k_dim * block_v // 1024))


def scratch_width(k_dim: int, v_dim: int | None = None) -> int:
    """fp32 words per (row, token, head) record of the scratch: dq, k, exp(g) [K each], beta,
    q.k, padded to whole 128-byte lines; with `v_dim` (`v_in_prep`) followed by the conv'd v
    [V] at `_v_offset(k_dim)`."""
    return _v_offset(k_dim) + (v_dim or 0)


def _v_offset(k_dim: int) -> int:
    return -(-(3 * k_dim + 2) // 32) * 32


def resolve_v_in_prep(v_in_prep: bool | None, steps: int) -> bool:
    """`kda_decode`'s default: the prep does the v conv for verify steps (T > 1), where it
    measured faster, and not at one token per row, where it made no difference
    (docs/perf/kda.md, "Tried and dropped")."""
    return steps > 1 if v_in_prep is None else v_in_prep


def decode_scratch(
    batch: int,
    steps: int,
    heads: int,
    k_dim: int,
    device: torch.device | str,
    v_dim: int | None = None,
    *,
    v_in_prep: bool | None = None,
) -> torch.Tensor:
    """An uninitialised scratch for `kda_decode(..., scratch=...)`: [B, T, H, D] fp32, for the
    same `v_in_prep` (`KdaDecodeTuning.v_in_prep`; None: the default, which needs `v_dim` when
    steps > 1)."""
    if resolve_v_in_prep(v_in_prep, steps):
        if v_dim is None:
            raise ValueError("the prep kernel keeps v in the scratch here: pass v_dim")
    else:
        v_dim = None
    return torch.empty(
        batch, steps, heads, scratch_width(k_dim, v_dim), dtype=torch.float32, device=device
    )


def _is_buffer(t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> bool:
    """Whether `t` is a contiguous tensor of `shape` (and of `dtype`, when given)."""
    return t.shape == shape and (dtype is None or t.dtype == dtype) and t.is_contiguous()


def check_inputs(
    qkv: torch.Tensor,
    f: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    slots: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    step_states: torch.Tensor | None,
    step_conv: torch.Tensor | None,
) -> None:
    """Validate the step's tensors as `kda_decode` documents them (shared with the comparison
    forms in benchmarks/kda_decode_variants.py)."""
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
    for name, t in (
        ("conv_state", conv_state),
        ("recurrent_state", recurrent_state),
        ("conv_weight", conv_weight),
        ("a_log", a_log),
        ("dt_bias", dt_bias),
        ("slots", slots),
    ):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if (step_states is None) != (step_conv is None):
        raise ValueError("pass both step_states and step_conv, or neither")
    if step_states is not None and not (
        _is_buffer(step_states, (batch, steps, heads, k_dim, v_dim), torch.float32)
        and _is_buffer(step_conv, (batch, steps, channels, width - 1))
    ):
        raise ValueError(
            "step_states / step_conv must be contiguous [B, T, H, K, V] fp32 and [B, T, C, W-1]"
        )


def _plan(
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
    scratch: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    tuning: KdaDecodeTuning | None = None,
) -> tuple[torch.Tensor, list]:
    """Validate the arguments of `kda_decode`; return (out, the launches still to run)."""
    check_gate_form(gate)
    tuning = tuning_or_default(tuning, KdaDecodeTuning)
    check_inputs(
        qkv, f, beta, conv_weight, conv_state, recurrent_state, slots, a_log, dt_bias,
        step_states, step_conv,
    )  # fmt: skip
    batch, steps, _ = qkv.shape
    _, heads, k_dim, v_dim = recurrent_state.shape
    width = conv_weight.shape[1]
    t = tuning.resolve(k_dim, v_dim, steps)
    block_v = t.block_v
    if not (is_pow2(k_dim) and is_pow2(v_dim) and is_pow2(block_v) and block_v <= v_dim):
        raise ValueError(
            f"K={k_dim}, V={v_dim}, block_v={block_v} must be powers of two, block_v <= V"
        )
    if out is None:
        out = qkv.new_empty(batch, steps, heads, v_dim)
    elif not _is_buffer(out, (batch, steps, heads, v_dim)):
        raise ValueError(f"out must be contiguous [{batch}, {steps}, {heads}, {v_dim}]")
    v_in_prep = t.v_in_prep
    record = scratch_width(k_dim, v_dim if v_in_prep else None)
    if scratch is None:
        scratch = decode_scratch(batch, steps, heads, k_dim, qkv.device, v_dim, v_in_prep=v_in_prep)
    elif not _is_buffer(scratch, (batch, steps, heads, record), torch.float32):
        raise ValueError(
            f"scratch must be contiguous [{batch}, {steps}, {heads}, {record}] "
            "fp32 (decode_scratch with v_dim and the same v_in_prep)"
        )
    # The ready counters: [B, H] int32, zero before and after each launch.
    if counters is None:
        counters = torch.zeros(batch, heads, dtype=torch.int32, device=qkv.device)
    elif not _is_buffer(counters, (batch, heads), torch.int32):
        raise ValueError(f"counters must be contiguous int32 [{batch}, {heads}] (zeros)")
    if batch == 0:
        return out, []
    use_pdl = pdl_enabled(qkv) if t.use_pdl is None else t.use_pdl
    launch = {"launch_pdl": True} if use_pdl else {}
    scale = float(k_dim**-0.5 if scale is None else scale)
    common = dict(
        H=heads,
        K=k_dim,
        V=v_dim,
        T=steps,
        W=width,
        WP=triton.next_power_of_2(width - 1 + steps),
        STORE_STEPS=step_states is not None,
        USE_PDL=use_pdl,
    )
    strides = (
        qkv.stride(0),
        qkv.stride(1),
        f.stride(0),
        f.stride(1),
        beta.stride(0),
        beta.stride(1),
    )
    overlap = t.overlap_prep
    return out, [
        lambda: _kda_prep_kernel[(batch * heads,)](
            qkv,
            f,
            beta,
            conv_weight,
            a_log,
            dt_bias,
            conv_state,
            slots,
            scratch,
            counters,
            step_conv,
            *strides,
            scale,
            float(lower_bound),
            D=record,
            NV=v_dim // block_v,
            RELEASE=overlap,
            V_IN_PREP=v_in_prep,
            VOFF=_v_offset(k_dim),
            EVICT_RECORD=t.record_eviction,
            LOWER_BOUND=gate == "lower_bound",
            num_warps=t.prep_warps,
            **common,
            **launch,
        ),
        lambda: _kda_recurrent_kernel[(batch * heads * (v_dim // block_v),)](
            qkv,
            conv_weight,
            conv_state,
            scratch,
            counters,
            recurrent_state,
            slots,
            out,
            step_states,
            step_conv,
            qkv.stride(0),
            qkv.stride(1),
            D=record,
            BV=block_v,
            OVERLAP=overlap,
            V_IN_PREP=v_in_prep,
            VOFF=_v_offset(k_dim),
            num_warps=t.num_warps,
            EVICT_LOAD=t.state_eviction[0],
            EVICT_STORE=t.state_eviction[1],
            **common,
            **launch,
        ),
    ]


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
    scratch: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    tuning: KdaDecodeTuning | None = None,
) -> torch.Tensor:
    """One decode / verify step of a KDA layer for B rows of T new tokens each.

    qkv: [B, T, 2*H*K + H*V] pre-conv q|k|v projections (model dtype);
    f: [B, T, H*K] raw gate (f_b(f_a(x)), before dt_bias); beta: [B, T, H] raw (before sigmoid);
    conv_weight: [C, W] depthwise taps of the stacked q|k|v channels; a_log: [H]; dt_bias: [H*K];
    conv_state: [S, C, W-1] pool (last W-1 inputs, oldest first); recurrent_state: [S, H, K, V]
    fp32 pool; slots: [B] int32/int64 slot of each row (padding rows may share a sink slot, whose
    contents then become garbage); gate: "softplus" or "lower_bound"; scale: q scale (K^-1/2).
    step_states [B, T, H, K, V] fp32 and step_conv [B, T, C, W-1] (both or neither): also keep
    the state after every token, for `kda_decode_rollback`.
    scratch: the prep kernel's [B, T, H, scratch_width(K, V)] fp32 records (`decode_scratch`
    with the same v_in_prep, contents irrelevant). counters: [B, H] int32, all zero (each
    launch leaves it zero again: allocate it once with torch.zeros and reuse it). Either is
    allocated per call when None (fine inside CUDA graph capture; for counters that adds a
    memset). tuning: the launch knobs (`KdaDecodeTuning`; None: the measured defaults).
    Returns o: [B, T, H, V] in qkv's dtype (or `out`). Both pools are updated in place.

    Preconditions: the last dim of qkv, f and beta is contiguous (rows may be strided views);
    pools, weights, out and the step buffers are contiguous; K, V and block_v are powers of two;
    no two real rows share a slot. No host sync: safe inside CUDA graphs.
    """
    out, launches = _plan(
        qkv,
        f,
        beta,
        conv_weight,
        a_log,
        dt_bias,
        conv_state,
        recurrent_state,
        slots,
        gate=gate,
        lower_bound=lower_bound,
        scale=scale,
        out=out,
        step_states=step_states,
        step_conv=step_conv,
        scratch=scratch,
        counters=counters,
        tuning=tuning,
    )
    for run in launches:
        run()
    return out


def kda_decode_stages(*args, **kwargs) -> list:
    """The launches `kda_decode(*args, **kwargs)` would make, as callables, without making them:
    [prep, recurrence]. For timing the stages separately (benchmarks/kda_decode.py); each call
    of one repeats that launch. The recurrence with one token per row waits for the ready
    counters the prep sets (see `kda_decode`'s `counters`): to run it without the prep, pass
    counters set to a large value (each of its programs takes one off), else it waits forever."""
    return _plan(*args, **kwargs)[1]


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
