"""`ModelRunner`: turns scheduler batches and cache handles into forward steps.

It builds the step's inputs (packed tokens, positions, page tables, state slots) over the cache's
device pools, runs the model in place on them, and returns the logits to sample from. Decode
steps go through the `DecodeGraphs` the runner builds when given a `DecodeGraphConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenspeed.cache import CacheManager, RequestCache
from tokenspeed.model import ForwardBatch, KimiForCausalLM, PagedKda, PagedMla, PagedState

from .graphs import DecodeGraphConfig, DecodeGraphs
from .verify_graphs import VerifyGraphs


class DevicePools:
    """The read-only view of one rank's cache that a runner builds step inputs over: each
    layer's device pool, a batch's page table and live slots, and the sink page and slot that
    padded rows point at.

    The runner holds this rather than the manager or the engine's port because it never changes
    what the cache holds (no allocation, checkpoint or release: the scheduler decides those,
    through the port); it reads the pools' layout, and the model writes through it only into
    the pages and live slots the scheduler reserved for the batch."""

    def __init__(self, cache: CacheManager) -> None:
        self._cache = cache
        self.page_size = cache.page_size
        self.sink_page = cache.sink_page
        self.sink_slot = cache.sink_slot

    def mla_layer(self, layer: int) -> torch.Tensor:
        return self._cache.mla_layer(layer)

    def kda_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.kda_layer(layer)

    def page_table_tensor(self, handles: Sequence[RequestCache], **kwargs) -> torch.Tensor:
        """As `CacheManager.page_table_tensor` (num_rows=, num_cols=, device=)."""
        return self._cache.page_table_tensor(handles, **kwargs)

    def live_slot_tensor(self, handles: Sequence[RequestCache], **kwargs) -> torch.Tensor:
        """As `CacheManager.live_slot_tensor` (num_rows=, device=)."""
        return self._cache.live_slot_tensor(handles, **kwargs)


class VerifyStep:
    """A speculative verify forward's results: `logits` [sum(seq_lens), vocab], every row of
    every request (request i's rows are `rows(i)`), and each KDA layer's per-token states, which
    `ModelRunner.rollback` reads to move the live slots back to the last kept token; `aux`: the
    auxiliary hidden states of every row when the runner captures them (else None).

    stride: rows fed `stride` tokens each, of which request i's first seq_lens[i] are its own
    (a `VerifyGraphs` step, whose windows are padded to one width); None: packed back to back."""

    def __init__(self, logits, seq_lens, slots, steps, aux=None, stride: int | None = None):
        self.logits = logits
        self.aux = aux
        self.seq_lens = list(seq_lens)
        self.slots = slots
        self.steps = steps  # kda layer -> (step_conv [B, T, C, W-1], step_states [B, T, ...])
        self._starts = [0]
        for i, n in enumerate(self.seq_lens):
            self._starts.append((i + 1) * stride if stride else self._starts[-1] + n)

    def rows(self, i: int) -> slice:
        return slice(self._starts[i], self._starts[i] + self.seq_lens[i])


class ModelRunner:
    def __init__(
        self,
        model: KimiForCausalLM,
        pools: DevicePools,
        device: torch.device,
        graphs: DecodeGraphConfig | None = None,
        aux_layers: Sequence[int] | None = None,
    ):
        """graphs: decode steps go through `DecodeGraphs` of this configuration (a CUDA device
        only), built once the runner is; None: every step runs eagerly, unpadded.
        aux_layers: capture points (`KimiForCausalLM.forward`'s aux_hidden_layers) of every
        eager forward and verify step, for an EAGLE3 drafter: the last eager forward's states
        are `aux_hidden` [tokens, n * D] (graph replays capture none)."""
        self.model = model
        self.aux_layers = None if aux_layers is None else tuple(aux_layers)
        self.aux_hidden: torch.Tensor | None = None
        self.pools = pools
        self.device = device
        config = model.config
        self.kda_layers = config.kda_layers
        self.mla_layers = config.mla_layers
        # The cache orders each kind's pools by position among that kind.
        self.kda_ordinal = {layer: i for i, layer in enumerate(self.kda_layers)}
        self.mla_ordinal = {layer: i for i, layer in enumerate(self.mla_layers)}
        # Model forwards begun and completed (graph replays included; not the captures): a
        # `LockstepEngine` checks that a step issued as many forwards as its peers expect.
        self.forwards_started = 0
        self.forwards_done = 0
        self.graphs = (
            None
            if graphs is None
            else DecodeGraphs(self, graphs.sizes, graphs.max_pages, capture=graphs.capture)
        )
        # A speculating engine's verify steps, padded to k + 1 tokens per row (graphs.py).
        self.verify_graphs = (
            None
            if graphs is None or not graphs.verify_width
            else VerifyGraphs(
                self,
                graphs.sizes,
                graphs.verify_width,
                graphs.max_pages,
                capture=graphs.capture,
                aux_layers=self.aux_layers,
            )
        )

    # ------------------------------------------------------------------ step inputs
    def paged_state(
        self, slots: torch.Tensor, page_table: torch.Tensor, steps: dict | None = None
    ) -> PagedState:
        """A PagedState over the cache's pools for rows with these slots and page table;
        steps: per KDA layer the (step_conv, step_states) buffers of a verify step."""
        kda = {}
        for layer in self.kda_layers:
            conv, rec = self.pools.kda_layer(self.kda_ordinal[layer])
            buffers = (None, None) if steps is None else steps[layer]
            kda[layer] = PagedKda(conv, rec, slots, *buffers)
        mla = {
            layer: PagedMla(self.pools.mla_layer(self.mla_ordinal[layer]), page_table)
            for layer in self.mla_layers
        }
        return PagedState(kda=kda, mla=mla)

    def _waiter(self, handles: Sequence[RequestCache]):
        """before_layer hook: wait for each layer's prefix copies of requests still loading."""
        loads = [h.load for h in handles if h.load is not None and not h.load.done()]
        if not loads:
            return None
        kda, mla = self.kda_ordinal, self.mla_ordinal

        def wait(layer: int) -> None:
            for load in loads:
                if layer in kda:
                    load.wait_kda(kda[layer])
                else:
                    load.wait_mla(mla[layer])

        return wait

    # ------------------------------------------------------------------ forwards
    def forward(
        self,
        tokens: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        handles: Sequence[RequestCache],
        logits_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Eager forward of one step: request i computes `tokens[i]` after `prefix_lens[i]`
        cached tokens. Returns the logits of each request's last token, [len(logits_rows)
        or B, vocab] for the requests listed in `logits_rows` (all by default)."""
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=self.device)
        return self._forward(ids, [len(t) for t in tokens], prefix_lens, handles, logits_rows)

    def _forward(
        self,
        ids: torch.Tensor,
        seq_lens: Sequence[int],
        prefix_lens: Sequence[int],
        handles: Sequence[RequestCache],
        logits_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """`forward` over packed token ids already on the device ([sum(seq_lens)] int64)."""
        self.forwards_started += 1
        batch = ForwardBatch.build(seq_lens, prefix_lens, device=self.device)
        slots = self.pools.live_slot_tensor(handles, device=self.device)
        table = self.pools.page_table_tensor(handles, device=self.device)
        last = batch.last_token_indices
        if logits_rows is not None:
            last = last[torch.tensor(list(logits_rows), dtype=torch.long, device=self.device)]
        out = self.model(
            ids,
            batch,
            self.paged_state(slots, table),
            logits_indices=last,
            before_layer=self._waiter(handles),
            **self._aux(),
        )
        self.aux_hidden = getattr(out, "aux_hidden", None)
        self.forwards_done += 1
        return out.logits

    def _aux(self) -> dict:
        # Only when asked: the forwards of other models (a DCP rank's) take no such argument.
        return {} if self.aux_layers is None else {"aux_hidden_layers": self.aux_layers}

    def verify(
        self,
        tokens: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        handles: Sequence[RequestCache],
    ) -> VerifyStep:
        """A speculative verify forward: request i computes `tokens[i]` (its last token and
        its drafts, 1..4 tokens) after `prefix_lens[i]` cached tokens, with the logits of every
        row and each KDA layer's state after each token kept for `rollback`. The MLA rows of
        all its tokens are written (by position: a rejected row is overwritten later).
        Through `VerifyGraphs` when the runner has them and the batch fits (windows padded to
        one width); else eagerly, windows packed as they are."""
        self.forwards_started += 1
        seq_lens = [len(t) for t in tokens]
        graphs = self.verify_graphs
        if graphs is not None and graphs.fits(len(tokens), prefix_lens):
            logits, aux, steps, slots = graphs.run(tokens, prefix_lens, handles)
            self.forwards_done += 1
            return VerifyStep(logits, seq_lens, slots, steps, aux, stride=graphs.width)
        ids = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long, device=self.device)
        batch = ForwardBatch.build(seq_lens, prefix_lens, device=self.device)
        slots = self.pools.live_slot_tensor(handles, device=self.device)
        table = self.pools.page_table_tensor(handles, device=self.device)
        rows, width = len(seq_lens), max(seq_lens)
        steps = {}
        for layer in self.kda_layers:
            conv, rec = self.pools.kda_layer(self.kda_ordinal[layer])
            steps[layer] = (
                conv.new_zeros(rows, width, *conv.shape[1:]),
                rec.new_zeros(rows, width, *rec.shape[1:], dtype=torch.float32),
            )
        every = torch.arange(ids.shape[0], device=self.device)
        out = self.model(
            ids,
            batch,
            self.paged_state(slots, table, steps),
            logits_indices=every,
            before_layer=self._waiter(handles),
            **self._aux(),
        )
        self.forwards_done += 1
        return VerifyStep(out.logits, seq_lens, slots, steps, getattr(out, "aux_hidden", None))

    def rollback(self, step: VerifyStep, kept: Sequence[int]) -> None:
        """Move each request's live KDA state (conv and recurrent, every KDA layer) to just after
        its first `kept[i]` tokens of `step` (1..seq_lens[i]; all of them: a no-op copy)."""
        # `ops.kda.decode.kda_decode_rollback`'s copy, without importing the Triton module.
        last = torch.tensor([n - 1 for n in kept], dtype=torch.long, device=self.device)
        rows = torch.arange(len(kept), device=self.device)
        index = step.slots.to(torch.long)
        for layer in self.kda_layers:
            conv, rec = self.pools.kda_layer(self.kda_ordinal[layer])
            step_conv, step_states = step.steps[layer]
            rec.index_copy_(0, index, step_states[rows, last].to(rec.dtype))
            conv.index_copy_(0, index, step_conv[rows, last].to(conv.dtype))

    def empty_forward(self) -> torch.Tensor:
        """One forward over no requests ([0, vocab] logits), on the cache's pools over zero rows:
        every layer runs on 0 tokens, joining whatever collectives its forward issues (the DEP
        all-to-alls), and nothing in the cache is read or written."""
        ids = torch.zeros(0, dtype=torch.long, device=self.device)
        return self._forward(ids, [], [], [])

    def decode(
        self,
        tokens: Sequence[int] | torch.Tensor,
        prefix_lens: Sequence[int],
        handles: Sequence[RequestCache],
    ) -> torch.Tensor:
        """One token for each of B requests: [B, vocab] logits (graph replay when possible).

        tokens: the B input tokens, as ints or as a [B] int64 device tensor (a previous step's
        samples: multi-step decoding feeds them without a trip through the host)."""
        if self.graphs is not None and self.graphs.fits(len(tokens), prefix_lens):
            self.forwards_started += 1
            logits = self.graphs.run(tokens, prefix_lens, handles)
            self.forwards_done += 1
            return logits
        if isinstance(tokens, torch.Tensor):
            return self._forward(tokens.to(torch.long), [1] * len(tokens), prefix_lens, handles)
        return self.forward([[t] for t in tokens], prefix_lens, handles)
