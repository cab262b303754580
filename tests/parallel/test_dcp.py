"""Decode context parallelism on CPU ranks: the MLA cache split by interleaved positions, the
partial attention merged with its log-sum-exp, the logits those of the single-process model."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenspeed.model import (
    BatchError,
    DecoderState,
    ForwardBatch,
    KimiForCausalLM,
    PagedKda,
    PagedMla,
    PagedState,
    get_preset,
)
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel.comm import CommLog
from tokenspeed.parallel.dcp import DcpGatedMla, apply_dcp, local_rows, merge_partials
from tokenspeed.parallel.dims import ParallelDims
from tokenspeed.parallel.groups import Group, ParallelGroups

from .harness import run_ranks

PAGE = 2
# Per step, new tokens of requests 0, 1, 2 (0: the request sits the step out): a packed
# prefill of uneven lengths (one shorter than the group), an extension of cached prefixes
# (expanded form), decode steps and a short verify (absorbed form).
PLAN = [[5, 2, 7], [6, 0, 9], [1, 1, 1], [1, 1, 0], [3, 1, 2], [1, 1, 1]]


def _model():
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)


def _tokens():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (sum(s[r] for s in PLAN),), generator=gen) for r in range(3)]


class LocalPools:
    """Paged pools of one rank: KDA slots as usual, MLA pages for its local rows only (garbage
    elsewhere, so a read of a row the rank does not own shows)."""

    def __init__(self, config, member, size, num_pages=40):
        gen = torch.Generator().manual_seed(100 + member)
        self.member, self.size = member, size
        kda = config.kda
        self.conv = {
            i: torch.zeros(4, kda.conv_channels, kda.conv_kernel - 1) for i in config.kda_layers
        }
        self.rec = {
            i: torch.zeros(4, kda.num_heads, kda.head_dim, kda.head_dim) for i in config.kda_layers
        }
        self.pages = {
            i: torch.randn(num_pages, PAGE, config.mla.latent_width, generator=gen)
            for i in config.mla_layers
        }
        self.free = list(range(num_pages - 1, 0, -1))  # page 0: the sink
        self.tables = {r: [] for r in range(3)}

    def state(self, requests, total_lens):
        for r, n in zip(requests, total_lens, strict=True):
            while len(self.tables[r]) * PAGE < local_rows(n, self.member, self.size):
                self.tables[r].append(self.free.pop())
        width = max(1, *(len(self.tables[r]) for r in requests))
        table = torch.zeros(len(requests), width, dtype=torch.long)
        for row, r in enumerate(requests):
            table[row, : len(self.tables[r])] = torch.tensor(self.tables[r], dtype=torch.long)
        slots = torch.tensor([r + 1 for r in requests])
        return PagedState(
            kda={i: PagedKda(self.conv[i], self.rec[i], slots) for i in self.conv},
            mla={i: PagedMla(self.pages[i], table) for i in self.pages},
        )

    def rows(self, layer, request, length):
        pages = self.pages[layer][self.tables[request]]
        return pages.reshape(-1, pages.shape[-1])[: local_rows(length, self.member, self.size)]


def _dcp_steps(rank, world):
    model = _model()
    reference = copy.deepcopy(model)
    groups = ParallelGroups.build(ParallelDims(world_size=world, dcp=world))
    log = CommLog()
    report = apply_dcp(model, groups, log=log)
    size, member = world, groups["dcp"].index
    config = model.config
    seqs = _tokens()
    ref_states = [reference.empty_state() for _ in seqs]
    dcp_states = [model.empty_state() for _ in seqs]
    pools = LocalPools(config, member, size)
    done = [0, 0, 0]
    errors, merge_bytes, tokens = [], [], 0
    for step in PLAN:
        reqs = [r for r, n in enumerate(step) if n]
        lens = [step[r] for r in reqs]
        ids = torch.cat([seqs[r][done[r] : done[r] + step[r]] for r in reqs])
        batch = ForwardBatch.build(lens, [done[r] for r in reqs])
        want = reference(ids, batch, DecoderState.concat([ref_states[r] for r in reqs]))
        before = log.sent[MERGE]
        got = model(ids, batch, DecoderState.concat([dcp_states[r] for r in reqs]))
        merge_bytes.append(log.sent[MERGE] - before)
        paged = model(ids, batch, pools.state(reqs, batch.total_lens))
        tokens += len(ids)
        errors.append(
            (
                float((got.logits - want.logits).abs().max()),
                float((paged.logits - want.logits).abs().max()),
            )
        )
        for r, ref, new in zip(reqs, want.state.split(), got.state.split(), strict=True):
            ref_states[r], dcp_states[r], done[r] = ref, new, done[r] + step[r]
    # The cache each rank kept: only its positions, the single-process rows there.
    shares = {}
    for layer in config.mla_layers:
        for r in range(3):
            full = ref_states[r].mla[layer][0]
            mine = full[member::size]
            explicit = dcp_states[r].mla[layer][0]
            shares[layer, r] = (
                tuple(explicit.shape),
                float((explicit - mine).abs().max()) if mine.numel() else 0.0,
                float((pools.rows(layer, r, done[r]) - mine).abs().max()) if mine.numel() else 0.0,
                done[r],
            )
    # The wrapped input check refuses a full-length (unsplit) cache.
    full_state = ref_states[0]
    refused = False
    try:
        model(seqs[0][:1], ForwardBatch.build([1], [done[0]]), full_state)
    except BatchError:
        refused = True
    layer_classes = {type(m.self_attn).__name__ for m in model.model.layers if m.kind == "mla"}
    return dict(
        errors=errors,
        shares=shares,
        merge_bytes=merge_bytes,
        calls=log.calls[MERGE],
        refused=refused or size == 1,
        report=(report.weight_bytes_before, report.weight_bytes_after),
        classes=layer_classes,
    )


MERGE = "dcp.merge"


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_matches_single_process_and_keeps_only_its_share(world):
    results = run_ranks(_dcp_steps, world, timeout=240)
    config = get_preset("tiny")
    mla = config.mla
    n_mla = len(config.mla_layers)
    for member, res in enumerate(results):
        for step, (explicit, paged) in enumerate(res["errors"]):
            assert explicit <= 2e-5, (member, step, explicit)
            assert paged <= 2e-5, (member, step, paged)
        for (layer, r), (shape, err, paged_err, length) in res["shares"].items():
            assert shape == (local_rows(length, member, world), mla.latent_width)
            assert err <= 1e-5 and paged_err <= 1e-5, (layer, r, err, paged_err)
        for step, nbytes in zip(PLAN, res["merge_bytes"], strict=True):
            per_layer = (world - 1) * sum(step) * mla.num_heads * (mla.v_head_dim + 1) * 4
            assert nbytes == n_mla * per_layer
        assert res["calls"] == 2 * len(PLAN) * n_mla  # explicit and paged runs
        assert res["refused"]
        assert res["report"][0] == res["report"][1]
        assert res["classes"] == {"DcpGatedMla"}
    # A request shorter than the group leaves the last members with no rows at all.
    assert local_rows(2, 3, 4) == 0 and local_rows(5, 0, 4) == 2 and local_rows(5, 1, 4) == 1


def test_merge_is_exact_for_any_split_in_one_process():
    """The merge formula on a size-1 group is the identity; over split rows it is exact."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 2, 10, generator=gen)  # [T, H, L]
    values = torch.randn(10, 5, generator=gen)
    full = torch.einsum("thl,ld->thd", scores.softmax(-1), values)
    parts = []
    for idx in (torch.arange(0, 10, 3), torch.arange(1, 10, 3), torch.arange(2, 10, 3)):
        s = scores[..., idx]
        lse = torch.logsumexp(s, -1)
        parts.append((torch.einsum("thl,ld->thd", (s - lse[..., None]).exp(), values[idx]), lse))
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    merged = sum((p[1] - lse).exp()[..., None] * p[0] for p in parts)
    assert torch.allclose(merged, full, atol=1e-6)
    alone = Group(None, (0,), 0)
    assert merge_partials(full, lse, alone) is full
    assert DcpGatedMla.__mro__[1].__name__ == "GatedMla"
