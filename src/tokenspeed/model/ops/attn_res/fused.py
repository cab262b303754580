"""AttnRes mix + the RMSNorm that follows it, with the bank update, in one Triton pass.

Semantics (`mix_norm_reference` spells them out with the torch references):

    bank: [N, T, D]  entries 0..N-2 are completed block sums (oldest first), N-1 the partial
    if delta is given:  bank[N-1] <- bank[N-1] + delta   (accumulate, rounded to bank dtype)
                        bank[N-1] <- delta               (not accumulate: a block just opened)
    mix  = attn_res_mix([bank[0], ..., bank[N-1]], query, mix_weight, mix_eps)   (bank dtype)
    out  = rms_norm(mix, norm_weight, norm_eps)                                  (bank dtype)

Relative to `layers/decoder.py`: `forward_attn_res` computes `partial + out` (or `out` at a
block's first layer) and then `post_attention_layernorm(mlp_res([*bank, partial]))`; this op
is that whole sequence with delta = the attention output, and, at the next layer's attention
site, `input_layernorm(self_attention_res([*bank, partial + mlp_out]))` with delta = the MLP
output (so the residual add of the MLP is fused here too). The final `output_attn_res` + norm
is the same call with the model's final norm weight.

Per token one program reads each entry once (online softmax over entries, fp32), so the
traffic is N (+1 with delta) reads and 1 (+1) writes of a [T, D] row set.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ..interpret import interpreting
from ..moe._launch import EVICTION_POLICIES
from ..norm import rms_norm
from ..tuning import check, integer, one_of, tuning_or_default, warp_count
from .reference import attn_res_mix


@attrs.frozen(kw_only=True)
class AttnResTuning:
    """The tuning knobs of `attn_res_mix_norm`; the defaults are the measured ones (None: by
    bank size, `default_launch`, from the H200 sweep of benchmarks/attn_res.py). None of them
    changes the result.

    block_entries: entries per load (0: the unrolled form; a power of two: a loop over that
    many per [block_entries, D] load); num_warps: the kernel's warps; stages (the loop form
    only): 0 prefetches the next tile in registers, >= 2 lets Triton's pipeliner keep
    stages - 1 tiles in flight through shared memory (None: `default_launch`'s when
    block_entries is None too, else 0); bank_eviction: Triton's `eviction_policy` of the loads
    of the completed entries ("" for none): evict-first, since they are read once per call and
    not again until the next layer's call.
    """

    block_entries: int | None = attrs.field(default=None, validator=integer(low=0, pow2=True))
    num_warps: int | None = attrs.field(default=None, validator=warp_count())
    stages: int | None = attrs.field(
        default=None,
        validator=check(lambda v: isinstance(v, int) and (v == 0 or v >= 2), "0 or >= 2"),
    )
    bank_eviction: str = attrs.field(default="evict_first", validator=one_of(EVICTION_POLICIES))

    def resolve(self, entries: int, dim: int, tokens: int) -> tuple[int, int, int]:
        """(block_entries, num_warps, stages) of a launch over an [entries, tokens, dim] bank."""
        auto_entries, auto_warps, auto_stages = default_launch(entries, dim, tokens)
        block_entries, stages = self.block_entries, self.stages
        if block_entries is None:
            block_entries = auto_entries
            stages = auto_stages if stages is None else stages
        if stages is None or block_entries == 0:
            stages = 0  # the register prefetch; the unrolled form has no loop to pipeline
        num_warps = auto_warps if self.num_warps is None else self.num_warps
        return block_entries, num_warps, stages


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _score(v, qw, D, mix_eps, axis: tl.constexpr, ONE_REDUCE: tl.constexpr):
    """rmsnorm(v) . qw along `axis`.

    ONE_REDUCE: both sums in one two-operand reduction, so one exchange through shared memory
    (and one barrier) instead of two; that latency is most of the time of a program at decode
    sizes. `tl.sum` is the same reduction with one operand, so each sum is added up in the same
    order either way. Off under the CPU interpreter only, which runs a reduction with its own
    combine function as a Python loop over the elements, in another order than numpy's sum."""
    if ONE_REDUCE:
        dot, sq = tl.reduce((v * qw, v * v), axis, _add_pair)
    else:
        dot = tl.sum(v * qw, axis=axis)
        sq = tl.sum(v * v, axis=axis)
    return dot * tl.rsqrt(sq / D + mix_eps)


@triton.jit
def _online_softmax_step(v, qw, m, den, acc, D, mix_eps, ONE_REDUCE: tl.constexpr):
    """Fold one entry v [BD] (fp32) into the running max m, denominator den and weighted sum
    acc [BD]; its score is rmsnorm(v) . qw."""
    score = _score(v, qw, D, mix_eps, 0, ONE_REDUCE)
    m_new = tl.maximum(m, score)
    rescale = tl.exp(m - m_new)
    p = tl.exp(score - m_new)
    return m_new, den * rescale + p, acc * rescale + p * v


@triton.jit
def _mix_norm_kernel(
    bank_ptr,
    delta_ptr,
    q_ptr,
    mw_ptr,
    nw_ptr,
    out_ptr,
    stride_bn,
    stride_bt,
    stride_dt,
    stride_ot,
    mix_eps,
    norm_eps,
    D: tl.constexpr,
    N: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BD: tl.constexpr,
    BL: tl.constexpr,
    STAGES: tl.constexpr,
    ONE_REDUCE: tl.constexpr,
    EVICT_BANK: tl.constexpr,
):
    """bank: [N, T, D] (last dim contiguous); delta: [T, D]; q, mw, nw: [D]; out: [T, D].

    D is a compile-time constant so the lanes of the padded [BD] row past D are known dead and
    hold no registers (K3: 7168 of 8192), which is what lets 4 warps run without spilling.
    BL = 0: the loop over entries unrolled, the next entry loaded while the current one is
    reduced, the partial entry held from the start. BL >= 1: a loop (not unrolled) over
    [BL, BD] tiles of all N entries, the next tile loaded before the current one is reduced;
    the tile holding the partial entry applies the delta and writes it back."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    dmask = d < D
    qw = tl.load(q_ptr + d, mask=dmask, other=0.0).to(tl.float32) * tl.load(
        mw_ptr + d, mask=dmask, other=0.0
    ).to(tl.float32)
    row = bank_ptr + t * stride_bt + d
    dtype = bank_ptr.dtype.element_ty

    # Online softmax over the entries: one read of each, running max / denominator / sum.
    m = -float("inf")
    den = 0.0
    acc = tl.zeros([BD], dtype=tl.float32)
    if BL == 0:
        partial = tl.load(row + (N - 1) * stride_bn.to(tl.int64), mask=dmask, other=0.0)
        if HAS_DELTA:
            delta = tl.load(delta_ptr + t * stride_dt + d, mask=dmask, other=0.0)
            if ACCUMULATE:
                partial = (partial.to(tl.float32) + delta.to(tl.float32)).to(dtype)
            else:
                partial = delta.to(dtype)
        # The loop is unrolled (N is a compile-time constant), so every program keeps a load
        # in flight while it reduces.
        if N == 1:
            ahead = partial
        else:
            ahead = tl.load(row, mask=dmask, other=0.0, eviction_policy=EVICT_BANK)
        if N == 1:
            # A softmax over one entry is 1: the mix is the entry, no score to reduce.
            acc = ahead.to(tl.float32)
            den = 1.0
        for i in tl.static_range(N if N > 1 else 0):
            v = ahead.to(tl.float32)
            if i + 2 < N:
                ahead = tl.load(
                    row + (i + 1) * stride_bn.to(tl.int64),
                    mask=dmask,
                    other=0.0,
                    eviction_policy=EVICT_BANK,
                )
            elif i + 2 == N:
                ahead = partial
            m, den, acc = _online_softmax_step(v, qw, m, den, acc, D, mix_eps, ONE_REDUCE)
        if HAS_DELTA:  # stored last, so no load above waits on it
            tl.store(row + (N - 1) * stride_bn.to(tl.int64), partial, mask=dmask)
    else:
        e = tl.arange(0, BL)
        if STAGES == 0:
            ahead = tl.load(
                row + e.to(tl.int64)[:, None] * stride_bn,
                mask=(e < N)[:, None] & dmask[None, :],
                other=0.0,
                eviction_policy=EVICT_BANK,
            )
        for first in tl.range(0, N, BL, num_stages=max(STAGES, 1)):
            idx = first + e  # [BL] entry indices of this tile
            if STAGES == 0:  # the next tile in registers while this one is reduced
                tile = ahead
                nxt = idx + BL
                ahead = tl.load(  # all lanes masked off after the last tile: no traffic
                    row + nxt.to(tl.int64)[:, None] * stride_bn,
                    mask=(nxt < N)[:, None] & dmask[None, :],
                    other=0.0,
                    eviction_policy=EVICT_BANK,
                )
            else:  # Triton's pipeliner keeps STAGES - 1 tiles in flight through shared memory
                tile = tl.load(
                    row + idx.to(tl.int64)[:, None] * stride_bn,
                    mask=(idx < N)[:, None] & dmask[None, :],
                    other=0.0,
                    eviction_policy=EVICT_BANK,
                )
            if HAS_DELTA:  # noqa: SIM102 (a constexpr and a loop value: Triton needs two ifs)
                if first + BL >= N:  # this tile holds the partial entry N-1
                    delta = tl.load(delta_ptr + t * stride_dt + d, mask=dmask, other=0.0)
                    if ACCUMULATE:
                        upd = (tile.to(tl.float32) + delta.to(tl.float32)[None, :]).to(dtype)
                    else:
                        upd = tl.broadcast_to(delta.to(dtype)[None, :], (BL, BD))
                    is_partial = (idx == N - 1)[:, None]
                    tile = tl.where(is_partial, upd, tile)
                    tl.store(
                        row + idx.to(tl.int64)[:, None] * stride_bn,
                        tile,
                        mask=is_partial & dmask[None, :],
                    )
            v = tile.to(tl.float32)  # [BL, BD]
            emask = idx < N
            score = _score(v, qw[None, :], D, mix_eps, 1, ONE_REDUCE)
            score = tl.where(emask, score, -float("inf"))
            m_new = tl.maximum(m, tl.max(score, axis=0))
            rescale = tl.exp(m - m_new)
            p = tl.exp(score - m_new)  # masked entries: exp(-inf) = 0
            den = den * rescale + tl.sum(p, axis=0)
            acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
            m = m_new

    mix = (acc / den).to(dtype).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(mix * mix, axis=0) / D + norm_eps)
    normed = (mix * rstd).to(dtype).to(tl.float32)
    out = normed * tl.load(nw_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def default_launch(entries: int, dim: int, tokens: int) -> tuple[int, int, int]:
    """(block_entries, num_warps, stages) by bank size, from `benchmarks/attn_res.py --sweep` on
    the H200 (docs/perf/attn_res.md). At K3's hidden size:
    - up to 64 tokens (fewer programs than SMs: each program's latency is the time) 8 warps,
      the unrolled form up to 2 entries, 3-4 entries in one [4, D] tile (one reduction for
      all scores: 1.06-1.25x the 2-per-load loop in graphs), 2 entries per load beyond;
    - from 4k tokens 4 warps (two programs per SM), the unrolled form up to 2 entries, beyond
      it the entry loop with the pipeliner keeping 2 (up to 4 entries) or 3 entries in flight
      through shared memory: 7-14% faster than the register prefetch at 4-8 entries, which
      holds one entry ahead at most (255 registers already);
    - in between 4 warps with the register prefetch (the pipelined loop was up to 12% slower
      at 256 tokens x 8 entries)."""
    bd = triton.next_power_of_2(dim)
    if bd < 4096:
        return 0, 4 if bd >= 1024 else 2, 0
    if tokens <= 64:
        if entries <= 2:
            return 0, 8, 0
        return (4, 8, 0) if entries <= 4 else (2, 8, 0)
    if entries <= 2:
        return 0, 4, 0
    if tokens < 4096:
        return 1, 4, 0
    return 1, 4, 3 if entries <= 4 else 4


def attn_res_mix_norm(
    bank: torch.Tensor,
    query: torch.Tensor,
    mix_weight: torch.Tensor,
    mix_eps: float,
    norm_weight: torch.Tensor,
    norm_eps: float,
    *,
    delta: torch.Tensor | None = None,
    accumulate: bool = True,
    tuning: AttnResTuning | None = None,
) -> torch.Tensor:
    """Fused AttnRes mix + RMSNorm (+ in-place update of the partial entry bank[N-1]).

    bank: [N, T, D], 1 <= N <= 16, last dim contiguous (e.g. a view of a preallocated
    [blocks + 1, T, D] buffer); query: [D] or [1, D]; mix_weight, norm_weight: [D];
    delta: [T, D] or None. Returns the normalised mix [T, D] in bank's dtype.
    tuning: the launch knobs (`AttnResTuning`; None: the measured defaults); the result is
    the same.
    """
    n, tokens, dim = bank.shape
    tuning = tuning_or_default(tuning, AttnResTuning)
    block_entries, num_warps, stages = tuning.resolve(n, dim, tokens)
    if not 1 <= n <= 16:
        raise ValueError(f"bank holds {n} entries; 1..16 supported")
    if bank.stride(2) != 1:
        raise ValueError("bank must be contiguous along D")
    if delta is not None and (delta.shape != (tokens, dim) or delta.stride(1) != 1):
        raise ValueError(f"delta must be [{tokens}, {dim}] contiguous along D")
    query = query.reshape(-1)
    if query.shape[0] != dim or mix_weight.shape != (dim,) or norm_weight.shape != (dim,):
        raise ValueError(f"query / weights must have {dim} elements")
    out = torch.empty(tokens, dim, dtype=bank.dtype, device=bank.device)
    if tokens == 0:
        return out
    _mix_norm_kernel[(tokens,)](
        bank,
        delta if delta is not None else out,
        query,
        mix_weight,
        norm_weight,
        out,
        bank.stride(0),
        bank.stride(1),
        delta.stride(0) if delta is not None else 0,
        out.stride(0),
        float(mix_eps),
        float(norm_eps),
        D=dim,
        N=n,
        HAS_DELTA=delta is not None,
        ACCUMULATE=accumulate,
        BD=triton.next_power_of_2(dim),
        BL=block_entries,
        STAGES=stages,
        ONE_REDUCE=not interpreting(),
        EVICT_BANK=tuning.bank_eviction,
        num_warps=num_warps,
    )
    return out


def mix_norm_reference(
    bank: torch.Tensor,
    query: torch.Tensor,
    mix_weight: torch.Tensor,
    mix_eps: float,
    norm_weight: torch.Tensor,
    norm_eps: float,
    *,
    delta: torch.Tensor | None = None,
    accumulate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch composition of what `attn_res_mix_norm` computes; does not modify bank.

    Returns (normalised mix [T, D], the partial entry after the update [T, D]).
    """
    entries = list(bank.unbind(0))
    if delta is not None:
        entries[-1] = entries[-1] + delta if accumulate else delta.to(bank.dtype)
    mix = attn_res_mix(entries, query, mix_weight, mix_eps)
    return rms_norm(mix, norm_weight, norm_eps), entries[-1]
