"""Decode context parallelism (DCP): one request's MLA latent cache split over the ranks of a group.

Every rank of a `dcp` group of C ranks runs the same requests and the same tokens (the KDA state,
the weights and everything else stay replicated); only the MLA latent rows are split, by
interleaved positions: token position p of a request lives on member `p % C` of the group, as
that member's local row `p // C`. Interleaving keeps the shares within one row of each other
whatever the length, and a decode step's new rows go round-robin over the members, so the cache
grows evenly without rebalancing. Member r of a request of L tokens holds
`local_rows(L, r, C) = ceil((L - r) / C)` rows (zero when L <= r).

In each MLA layer a member attends the step's queries over its own rows only (causally, by the
rows' global positions) and returns its partial output o_r = softmax_r(s) v with the log-sum-exp
lse_r of its scores (-inf where no row is visible); the partials are merged exactly:
lse = logsumexp_r lse_r, o = sum_r exp(lse_r - lse) o_r. The merge is one all-gather over the
group of [T, H, Dv + 1] fp32 per MLA layer (the per-head output after the value up-projection,
which is linear, so it commutes with the merge, and Dv < R makes it the cheaper side; the last
channel carries lse): (C - 1) * T * H * (Dv + 1) * 4 bytes sent per rank per layer, logged as
"dcp.merge". A step with no tokens sends nothing (every member runs the same tokens, so they all
skip it together).

The layer's forward is replaced by class swap (as FSDP2 does): each `GatedMla` becomes a
`DcpGatedMla` (same parameters, same names, same projections), whose forward writes only the
rows this rank owns and attends over its share. States: an explicit `DecoderState` holds per
request only the local rows [local_rows(L_i), R + Dr] (in position order); a `PagedMla`'s page
table lists the pages of the local rows (local row k of request i at row k % P of page
page_table[i, k // P]), so a rank's pages hold only its share. The model's input check expects
a full row per token; `apply_dcp` wraps the model's `check_inputs` (an instance attribute, the
class untouched) to check the local shapes instead.

The partial attention here is the torch reference (fp32, any device); on GPUs a kernel that
returns the log-sum-exp next to the output (FlashMLA and the split-KV decode kernels do) takes
its place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..model.batch import BatchError, ForwardBatch
from ..model.layers.mla import ABSORBED_MAX_TOKENS, GatedMla
from ..model.ops.mla import gather_pages
from ..model.state import DecoderState, PagedMla, PagedState
from .comm import CommLog
from .dims import ParallelError
from .groups import Group, ParallelGroups
from .report import TransformReport, tensor_bytes

MERGE = "dcp.merge"


def local_rows(length: int, member: int, size: int) -> int:
    """Rows member `member` of a group of `size` holds for a request of `length` tokens."""
    return max(0, (length - member + size - 1) // size)


def local_positions(length: int, member: int, size: int) -> torch.Tensor:
    """The global positions of those rows, in local order."""
    return torch.arange(member, length, size, dtype=torch.int64)


def partial_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    row_counts: torch.Tensor,
    token_request: torch.Tensor,
    positions: torch.Tensor,
    member: int,
    size: int,
    kv_b_weight: torch.Tensor,
    nope_dim: int,
    v_dim: int,
    scale: float,
    absorbed: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the step's queries over one member's share of the latent rows.

    q: [T, H, Dn + Dr]; rows: [B, L, R + Dr] each request's local rows (padded past
    row_counts [B]); token_request / positions: [T] each query's request and global position;
    local row k is global position member + k * size. Returns (o [T, H, Dv] fp32, lse [T, H]
    fp32), lse = -inf (and o = 0) for a query that sees none of these rows. absorbed: score in
    the R-wide latent space (few queries per request) or expand keys and values per row (many);
    the same numbers either way up to rounding.
    """
    heads = q.shape[1]
    rank = kv_b_weight.shape[1]
    w = kv_b_weight.float().reshape(heads, nope_dim + v_dim, rank)
    w_uk, w_uv = w[:, :nope_dim], w[:, nope_dim:]
    qf = q.float()
    mine = rows.float()[token_request]  # [T, L, W]: each query's request's rows
    c, k_rope = mine[..., :rank], mine[..., rank:]
    if absorbed:
        q_latent = torch.einsum("thd,hdr->thr", qf[..., :nope_dim], w_uk)
        scores = torch.einsum("thr,tlr->thl", q_latent, c)
    else:
        k_nope = torch.einsum("tlr,hdr->tlhd", c, w_uk)
        scores = torch.einsum("thd,tlhd->thl", qf[..., :nope_dim], k_nope)
    scores = scores + torch.einsum("thd,tld->thl", qf[..., nope_dim:], k_rope)
    local = torch.arange(rows.shape[1], device=q.device)
    row_pos = member + size * local  # [L]
    hidden = (local[None, :] >= row_counts[token_request][:, None]) | (
        row_pos[None, :] > positions[:, None]
    )  # [T, L]
    scores = (scores * scale).masked_fill(hidden[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [T, H]; -inf where every row is hidden
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    if absorbed:
        o_latent = torch.einsum("thl,tlr->thr", probs, c)
        o = torch.einsum("thr,hdr->thd", o_latent, w_uv)
    else:
        v = torch.einsum("tlr,hdr->tlhd", c, w_uv)
        o = torch.einsum("thl,tlhd->thd", probs, v)
    return o, lse


def merge_partials(
    o: torch.Tensor, lse: torch.Tensor, group: Group, log: CommLog | None = None
) -> torch.Tensor:
    """Exact merge of the members' partial attention: o [T, H, Dv], lse [T, H] (fp32) on each
    member -> sum_r exp(lse_r - lse) o_r with lse = logsumexp_r lse_r, on every member."""
    if group.size == 1 or o.shape[0] == 0:
        return o
    packed = torch.cat([o, lse.unsqueeze(-1)], -1).contiguous()
    if log is not None:
        log.record(MERGE, (group.size - 1) * packed.numel() * packed.element_size())
    parts = [torch.empty_like(packed) for _ in range(group.size)]
    dist.all_gather(parts, packed, group=group.handle)
    stacked = torch.stack(parts)  # [C, T, H, Dv + 1]
    lse_all = stacked[..., -1]
    total = torch.logsumexp(lse_all, 0)
    weight = torch.exp(lse_all - torch.where(torch.isfinite(total), total, 0.0))
    return (weight.unsqueeze(-1) * stacked[..., :-1]).sum(0)


class DcpGatedMla(GatedMla):
    """`GatedMla` over this rank's share of the latent rows (see the module docstring).

    Set by `apply_dcp` (class swap); `dcp_group` and `dcp_log` are plain attributes."""

    dcp_group: Group
    dcp_log: CommLog | None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, latents):
        group = self.dcp_group
        size, member = group.size, group.index
        q = self._queries(x)
        new_rows = self.latent_rows(x)
        owned = batch.positions % size == member
        if isinstance(latents, PagedMla):
            rows, counts = self._write_paged(latents, batch, new_rows, owned)
            new_state = latents
        else:
            dtype = latents[0].dtype if latents else x.dtype
            new_rows = new_rows.to(dtype)
            new_state = [
                torch.cat([latents[i], new_rows[seg][owned[seg]]]) for i, seg in batch.segments()
            ]
            counts = torch.tensor([r.shape[0] for r in new_state], dtype=torch.int64)
            width = new_rows.shape[1]
            rows = (
                nn.utils.rnn.pad_sequence(new_state, batch_first=True)
                if new_state
                else x.new_zeros(0, 0, width)
            )
        counts = counts.to(x.device)
        c = self.config
        absorbed = bool(batch.seq_lens) and max(batch.seq_lens) <= ABSORBED_MAX_TOKENS
        o, lse = partial_attention(
            q,
            rows,
            counts,
            batch.token_request,
            batch.positions,
            member,
            size,
            self.kv_b_proj.weight,
            c.qk_nope_head_dim,
            c.v_head_dim,
            c.softmax_scale,
            absorbed,
        )
        o = merge_partials(o, lse, group, self.dcp_log)
        return self._output(o.to(x.dtype), x), new_state

    def _write_paged(self, cache: PagedMla, batch, new_rows, owned):
        """Write the owned new rows at their local rows; return (rows [B, L, W], counts [B])."""
        size, member = self.dcp_group.size, self.dcp_group.index
        pages = cache.pages
        page_size = pages.shape[1]
        local = batch.positions // size
        token = owned.nonzero().flatten()
        page = cache.page_table[batch.token_request[token], local[token] // page_size].long()
        slot = page * page_size + local[token] % page_size
        flat = pages.view(-1, pages.shape[-1])
        flat.index_copy_(0, slot, new_rows[token].to(pages.dtype))
        counts = (batch.context_lens - member + size - 1).div(size, rounding_mode="floor")
        return gather_pages(pages, cache.page_table), counts.clamp_min(0)


def _check_local(original: Callable, group: Group, width: int, layers: tuple[int, ...]):
    """The model's input check over this rank's share: the MLA shapes are checked here against
    the local row counts, then the model's own check runs on a stand-in state whose MLA tensors
    are shape-only (meta) full-length ones."""

    def check_inputs(input_ids, batch: ForwardBatch, state) -> None:
        size, member = group.size, group.index
        if isinstance(state, DecoderState):
            seen = state.num_tokens
            for layer in layers:
                for i, (rows, n) in enumerate(zip(state.mla.get(layer, []), seen, strict=False)):
                    want = (local_rows(n, member, size), width)
                    if tuple(rows.shape) != want:
                        raise BatchError(
                            f"state.mla[{layer}][{i}] has shape {tuple(rows.shape)} but DCP "
                            f"member {member} of {size} holds {want} for a prefix of {n}"
                        )
            stand_in = DecoderState(
                kda=state.kda,
                mla={
                    layer: [torch.empty(n, width, device="meta") for n in seen]
                    if layer in state.mla and len(state.mla[layer]) == len(seen)
                    else state.mla[layer]
                    for layer in state.mla
                },
                num_tokens=state.num_tokens,
            )
            return original(input_ids, batch, stand_in)
        if isinstance(state, PagedState) and state.mla:
            longest = max(batch.total_lens) if batch.seq_lens else 0
            need = local_rows(longest, member, size)
            for layer, cache in state.mla.items():
                capacity = cache.page_table.shape[-1] * cache.pages.shape[1]
                if capacity < need:
                    raise BatchError(
                        f"state.mla[{layer}].page_table holds {capacity} local rows but DCP "
                        f"member {member} of {size} needs {need} for {longest} tokens"
                    )
            pages = torch.empty(1, 1, width, device="meta")

            def full(table: torch.Tensor) -> torch.Tensor:
                if table.dim() != 2:
                    return table  # the model's check names the problem
                return torch.empty(table.shape[0], max(longest, 1), device="meta")

            stand_in = PagedState(
                kda=state.kda,
                mla={layer: PagedMla(pages, full(c.page_table)) for layer, c in state.mla.items()},
            )
            return original(input_ids, batch, stand_in)
        return original(input_ids, batch, state)

    return check_inputs


def check_dcp(model: nn.Module, groups: ParallelGroups) -> None:
    """Refuse what `apply_dcp` cannot transform (see its preconditions), changing nothing."""
    if groups["dcp"].size == 1:
        return
    for prefix, module in model.named_modules():
        if isinstance(module, DcpGatedMla):
            raise ParallelError(f"apply_dcp was already applied ({prefix} is a DcpGatedMla)")
        if isinstance(module, GatedMla) and type(module) is not GatedMla:
            raise ParallelError(
                f"apply_dcp: {prefix} is a {type(module).__name__}, whose forward another "
                "transform replaced; apply_dcp needs the single-device GatedMla"
            )


def apply_dcp(model: nn.Module, groups: ParallelGroups, *, log: CommLog | None = None):
    """Split every MLA layer's latent cache over `groups["dcp"]` (interleaved positions) and
    merge the members' partial attention exactly with their log-sum-exp.

    Preconditions: every member of a dcp group is given the same requests and tokens each step
    (DCP is not data parallelism: outputs, the KDA state and all weights are replicated); the
    MLA layers are still `GatedMla` (no other transform has replaced their forward; transforms
    that replace projection submodules compose); `kv_b_proj.weight` is whole on the rank (it is
    read as a weight, never called). Not with `tep` (ParallelDims refuses it). The caller keeps
    each rank's MLA state in the local layout (see the module docstring): fresh requests start
    from `model.empty_state()` as usual (zero rows fit every layout).

    Communicates, per MLA layer and step: one all-gather of the partials over the dcp group,
    (C - 1) * T * H * (Dv + 1) * 4 bytes sent per rank (CommLog name "dcp.merge").
    Weights are not split: the report's bytes before and after are equal. With a dcp group of
    one rank nothing changes. Applying it twice is refused (`ParallelError`).
    """
    check_dcp(model, groups)
    group = groups["dcp"]
    before = tensor_bytes(model)
    if group.size == 1:  # nothing to split: the model keeps its single-device path
        return TransformReport("dcp", before, before)
    mla_layers = [m for m in model.modules() if type(m) is GatedMla]
    for module in mla_layers:
        module.__class__ = DcpGatedMla
        module.dcp_group = group
        module.dcp_log = log
    config = getattr(model, "config", None)
    if mla_layers and config is not None and hasattr(model, "check_inputs"):
        model.check_inputs = _check_local(
            model.check_inputs, group, config.mla.latent_width, config.mla_layers
        )
    return TransformReport("dcp", before, tensor_bytes(model))
