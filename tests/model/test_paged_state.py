"""The same forward over state held in shared pools (page tables, slot indices) as over explicit
per-request state: what the runtime's cache hands the model."""

import torch

from tokenspeed.model import DecoderState, ForwardBatch, PagedKda, PagedMla, PagedState

PAGE = 8


class Pools:
    """Pools with scattered pages and slots, like a cache that has been in use for a while."""

    def __init__(self, model, num_pages=64, num_slots=9, seed=0):
        cfg = model.config
        gen = torch.Generator().manual_seed(seed)
        # Garbage everywhere: nothing may read a row or slot it does not own.
        self.conv = {
            i: torch.randn(num_slots, cfg.kda.conv_channels, cfg.kda.conv_kernel - 1, generator=gen)
            for i in cfg.kda_layers
        }
        self.rec = {
            i: torch.randn(
                num_slots, cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.head_dim, generator=gen
            )
            for i in cfg.kda_layers
        }
        self.pages = {
            i: torch.randn(num_pages, PAGE, cfg.mla.latent_width, generator=gen)
            for i in cfg.mla_layers
        }
        self.free_pages = torch.randperm(num_pages - 1, generator=gen).add(1).tolist()
        self.tables: dict[int, list[int]] = {}

    def admit(self, request: int, slot: int):
        for i in self.conv:
            self.conv[i][slot].zero_()
            self.rec[i][slot].zero_()
        self.tables[request] = []

    def state(self, requests, slots, context_lens, width=None):
        for r, n in zip(requests, context_lens, strict=True):
            while len(self.tables[r]) * PAGE < n:
                self.tables[r].append(self.free_pages.pop())
        width = width or max(len(self.tables[r]) for r in requests)
        table = torch.zeros(len(requests), width, dtype=torch.long)  # 0 = sink page
        for row, r in enumerate(requests):
            table[row, : len(self.tables[r])] = torch.tensor(self.tables[r])
        slot_t = torch.tensor(slots)
        return PagedState(
            kda={i: PagedKda(self.conv[i], self.rec[i], slot_t) for i in self.conv},
            mla={i: PagedMla(self.pages[i], table) for i in self.pages},
        )


def _tokens(n, seed):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_paged_prefill_extend_decode_verify_match_explicit_state(model):
    seqs = [_tokens(n, seed=n) for n in (41, 17, 30)]
    slots = [7, 2, 5]  # ragged slot indices
    pools = Pools(model)
    for r, s in enumerate(slots):
        pools.admit(r, s)
    explicit = [model.empty_state() for _ in seqs]
    # prefill (all three, packed), extend, then decode and verify steps
    plan = [[20, 9, 30], [15, 8, 0], [1, 0, 0], [4, 0, 0], [1, 0, 0]]
    done = [0, 0, 0]
    for step in plan:
        reqs = [r for r, n in enumerate(step) if n]
        lens = [step[r] for r in reqs]
        ids = torch.cat([seqs[r][done[r] : done[r] + step[r]] for r in reqs])
        batch = ForwardBatch.build(lens, [done[r] for r in reqs])
        state = pools.state(reqs, [slots[r] for r in reqs], batch.total_lens)
        paged = model(ids, batch, state)
        want = model(ids, batch, DecoderState.concat([explicit[r] for r in reqs]))
        assert (paged.logits - want.logits).abs().max() <= 1e-4
        for r, new in zip(reqs, want.state.split(), strict=True):
            explicit[r], done[r] = new, done[r] + step[r]
    for r, slot in enumerate(slots):
        for i in pools.conv:
            assert torch.allclose(pools.rec[i][slot], explicit[r].kda[i].recurrent[0], atol=1e-4)
            assert torch.allclose(pools.conv[i][slot], explicit[r].kda[i].conv[0], atol=1e-5)
        for i in pools.pages:
            rows = pools.pages[i][pools.tables[r]].reshape(-1, pools.pages[i].shape[-1])
            assert torch.allclose(rows[: done[r]], explicit[r].mla[i][0], atol=1e-5)


def test_padded_decode_rows_only_touch_the_sink(tiny_model):
    model = tiny_model
    pools = Pools(model, seed=1)
    pools.admit(0, 3)
    ids = _tokens(12, seed=5)
    pre = ForwardBatch.build([11])
    model(ids[:11], pre, pools.state([0], [3], pre.total_lens))
    before = {i: t.clone() for i, t in pools.rec.items()}
    pages_before = {i: t.clone() for i, t in pools.pages.items()}
    # One real row plus three padding rows pointing at sink slot 0 and sink page 0.
    batch = ForwardBatch(
        seq_lens=(1, 1, 1, 1),
        prefix_lens=None,
        cu_seqlens=torch.arange(5),
        positions=torch.tensor([11, 0, 0, 0]),
        token_request=torch.arange(4),
        context_lens=torch.tensor([12, 1, 1, 1]),
    )
    state = pools.state([0], [3], [12], width=2)
    table = torch.zeros(4, 2, dtype=torch.long)
    table[0] = state.mla[model.config.mla_layers[0]].page_table[0]
    for m in state.mla.values():
        m.page_table = table
    for k in state.kda.values():
        k.slots = torch.tensor([3, 0, 0, 0])
    out = model(torch.cat([ids[11:], torch.zeros(3, dtype=torch.long)]), batch, state)
    alone = model(ids, ForwardBatch.build([12]), model.empty_state()).logits[-1]
    assert (out.logits[0] - alone).abs().max() <= 1e-4
    for i in pools.rec:
        changed = (pools.rec[i] != before[i]).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [0, 3]
    for i in pools.pages:
        changed = (pools.pages[i] != pages_before[i]).flatten(1).any(1).nonzero().flatten()
        assert set(changed.tolist()) <= {0, pools.tables[0][1]}
