"""`Eagle3Drafts`: an EAGLE3 drafter serving an engine's requests (docs/spec.md, section 5).

The drafter's KV is a `PagedDraftKv` pool of the cache's page count and page size: a request's
drafter row at position t is row t % P of page page_table[t // P], the page the cache gave the
target's MLA row t. No second allocator: the cache allocates, shares, evicts and frees pages
for the target, and the drafter's rows go with them (`drafter_page_bytes` is what each page
costs on top of the target's: `cache_sizing.plan_cache` sets it aside from the budget).

Per request it keeps the target's auxiliary hidden states the drafter has not extended over yet
(`observe`: positions [start, end), end = the tokens the target has computed). `propose` extends
the drafter over them (row p reads the token at p + 1 and the target's state at p) and chains
k - 1 single-row steps; the chain's rows, past `end`, are overwritten by the next extend.

Rows of cached pages: a prefix hit starts the request's states at the hit; the drafter's rows
before it are those its pages hold. On pages this engine computed they are the drafter's rows
of the same tokens (but the hit's last row, written with the token that followed it in the
earlier request); on pages copied in from the host tier (L2 carries the target's pages only)
they are whatever the page held before. Such rows cost acceptance, never correctness: the
verify step decides every emitted token. A preempted request keeps its pending states; on
resume its prefill continues them where it starts within them (else starts afresh there).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM
from tokenspeed.model.config import ConfigError
from tokenspeed.model.eagle3 import Eagle3Drafter, PagedDraftKv
from tokenspeed.model.eagle3_loader import load_eagle3
from tokenspeed.model.loader import CheckpointError

from ..config import EngineConfigError
from .config import SpeculativeConfig


def load_drafter(spec: SpeculativeConfig | None, target: KimiForCausalLM) -> Eagle3Drafter | None:
    """The EAGLE3 drafter `spec` names (None for another method), on the target's device and
    in its dtype, sharing its embedding when the checkpoint has none. A checkpoint that cannot
    draft for `target` (another vocabulary or hidden width, capture points past its layers, a
    broken or missing checkpoint) is refused with an `EngineConfigError` saying why."""
    if spec is None or spec.method != "eagle3":
        return None
    weight = target.lm_head.weight
    try:
        return load_eagle3(
            spec.draft_model, target=target, dtype=weight.dtype, device=weight.device
        )
    except (ConfigError, CheckpointError, OSError) as err:
        raise EngineConfigError(
            f"SpeculativeConfig.draft_model={spec.draft_model!r} cannot draft for this model: {err}"
        ) from err


def capture_points(drafter: Eagle3Drafter | None, target: KimiForCausalLM):
    """The target's capture points the drafter reads (None: no drafter)."""
    return None if drafter is None else drafter.config.capture_points(target.config.num_layers)


def drafter_page_bytes(drafter: Eagle3Drafter | None, page_size: int) -> int:
    """Bytes of the drafter's keys and values for one page of `page_size` positions (0: no
    drafter)."""
    if drafter is None:
        return 0
    config, element = drafter.config, drafter.lm_head.weight.element_size()
    return 2 * page_size * config.num_kv_heads * config.head_dim * element


class _Pending:
    """Auxiliary states of positions [start, end) not extended over yet (chunks [n_i, 3D])."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.chunks: list[torch.Tensor] = []
        self.count = 0

    @property
    def end(self) -> int:
        return self.start + self.count

    def append(self, aux: torch.Tensor) -> None:
        if aux.shape[0]:
            self.chunks.append(aux)
            self.count += aux.shape[0]

    def rows(self) -> torch.Tensor:
        return self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)

    def cut(self, position: int) -> None:
        """Drop the states at `position` and after (start <= position <= end)."""
        keep = position - self.start
        if keep < self.count:
            self.chunks = [self.rows()[:keep]] if keep else []
            self.count = keep


class Eagle3Drafts:
    """The drafter, its KV pool (`num_pages` pages of `page_size` rows on `device`) and each
    request's pending auxiliary states."""

    def __init__(
        self, drafter: Eagle3Drafter, num_pages: int, page_size: int, device: torch.device
    ) -> None:
        self.drafter = drafter
        dtype = drafter.lm_head.weight.dtype
        self.k, self.v = PagedDraftKv.pool(drafter.config, num_pages, page_size, dtype, device)
        self.device = device
        self._pending: dict[Hashable, _Pending] = {}

    @property
    def pool_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def observe(self, rid: Hashable, start: int, aux: torch.Tensor) -> None:
        """The target computed `len(aux)` positions of `rid` from `start`, with these auxiliary
        states [n, num_aux * D]. A start inside (or at the end of) the pending positions
        continues them (a later prefill chunk, a verify step's kept rows, a resumed prefill
        after a preemption); elsewhere (a prefill from a prefix hit) they start afresh."""
        pending = self._pending.get(rid)
        if pending is None or not pending.start <= start <= pending.end:
            pending = self._pending[rid] = _Pending(start)
        pending.cut(start)
        pending.append(aux)

    def forget(self, rid: Hashable) -> None:
        self._pending.pop(rid, None)

    def propose(
        self,
        records: Sequence,
        ks: Sequence[int],
        page_table: torch.Tensor,
        generators: Sequence[torch.Generator | None],
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Drafts for a decode batch: records[i] (a `RequestRecord`) drafts ks[i] tokens (0:
        none), its drafter rows at page_table[i]. Returns each row's drafts and, for sampled
        rows, the distributions [k, vocab] they were drawn from (None: greedy, point masses).
        A row whose pending states do not reach its computed tokens (none were captured for
        it) drafts nothing this step and starts collecting at its current length."""
        size = len(records)
        drafts: list[list[int]] = [[] for _ in range(size)]
        probs: list[torch.Tensor | None] = [None] * size
        groups: dict[int, list[int]] = {}
        for i, (record, k) in enumerate(zip(records, ks, strict=True)):
            if k <= 0:
                continue
            computed = record.sched.num_computed
            pending = self._pending.get(record.rid)
            if pending is None or pending.count == 0 or pending.end != computed:
                self._pending[record.rid] = _Pending(computed)
                continue
            groups.setdefault(k, []).append(i)
        for k, rows in groups.items():
            tokens, probs_k = self._propose(records, rows, k, page_table, generators)
            for j, i in enumerate(rows):
                drafts[i] = tokens[j]
                if probs_k is not None and not records[i].params.greedy:
                    probs[i] = probs_k[j]
        return drafts, probs

    def _propose(self, records, rows, k, page_table, generators):
        """One drafting round of k tokens for the batch rows `rows`, consuming their pending
        states: (tokens [len(rows)] lists of k target ids, probs [len(rows), k, vocab] | None)."""
        ids, aux, seq_lens, prefix_lens = [], [], [], []
        for i in rows:
            record = records[i]
            pending = self._pending[record.rid]
            ids.extend(record.tokens[pending.start + 1 : pending.end + 1])
            aux.append(pending.rows())
            seq_lens.append(pending.count)
            prefix_lens.append(pending.start)
            self._pending[record.rid] = _Pending(pending.end)
        batch = ForwardBatch.build(seq_lens, prefix_lens, device=self.device)
        index = torch.tensor(rows, dtype=torch.long, device=page_table.device)
        kv = PagedDraftKv(self.k, self.v, page_table[index])
        temps = [0.0 if records[i].params.greedy else records[i].params.temperature for i in rows]
        proposal = self.drafter.propose(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.cat(aux),
            batch,
            kv,
            k,
            temperatures=temps,
            generators=[generators[i] for i in rows],
        )
        probs = proposal.probs
        if probs is not None:
            probs = self.drafter.to_target_probs(probs)
        return proposal.tokens.tolist(), probs
