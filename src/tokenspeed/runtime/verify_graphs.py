"""`VerifyGraphs`: speculative verify steps captured as CUDA graphs, one per padded batch size.

A verify step feeds each row its last token and its drafts (docs/spec.md). Here every row is
fed exactly `width` = k + 1 tokens: a row with fewer drafts (its window is cut at a page
boundary or at its max_tokens, or it does not speculate) is padded at its end with copies of its
last real token. So every step has one shape per batch size, runs the fused paths of uniform
windows (the multi-query MLA decode kernel with a split plan, the fused KDA verify kernel with
per-token step states), and can be captured.

Why padding is harmless:
- attention and the recurrence are causal: a padded token comes after every real token of its
  row, and no real token reads it;
- its MLA row lands at a position past the row's window: in the row's own last page, where a
  later token overwrites it before anything reads it (as a rejected draft's row), or in a page
  the row does not hold yet, which its page table maps to the sink page;
- the live KDA state it leaves behind is replaced by `ModelRunner.rollback`, which always
  copies the state after the row's last kept token from the step buffers.
Rows past the real batch point at the sink page and slot, as in `DecodeGraphs`.

The KDA step buffers (each layer's conv and fp32 recurrent state after every fed token) are
allocated once for the largest size, [rows, width, ...] per KDA layer, and shared by every
graph (one replay at a time); their bytes are `step_buffer_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenspeed.cache import RequestCache
from tokenspeed.cache.host_copy import copy_into
from tokenspeed.model import ForwardBatch

from .graphs import capture_graphs, fill_split_plan, fill_tables, split_plans


class VerifyGraphs:
    """Verify steps of `width` tokens per row for batches up to max(sizes) rows, captured
    (capture=True) or run eagerly over the very same padded buffers (capture=False: the
    engine's eager mode on a GPU, which then computes the numbers the graphs do).

    `run` returns the step as `(logits, aux, steps, slots)`: logits [size * width, vocab] (row
    i's j-th token at i * width + j), the auxiliary hidden states of every fed token (None
    without capture points), each KDA layer's step buffers viewed [size, width, ...], and the
    batch's live slots. logits and steps are static buffers: valid until the next replay."""

    def __init__(
        self,
        runner,
        sizes: Sequence[int],
        width: int,
        max_pages: int,
        capture: bool = True,
        aux_layers: Sequence[int] | None = None,
    ):
        if not 1 <= width <= 4:
            raise ValueError(f"a verify step feeds 1..4 tokens per row, not {width}")
        self.runner = runner
        self.pools = runner.pools
        self.sizes = tuple(sorted(sizes))
        self.width = width
        self.max_pages = max_pages
        self.aux_layers = None if aux_layers is None else tuple(aux_layers)
        device = runner.device
        rows = self.sizes[-1]
        tokens = rows * width
        self.ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.arange(tokens, device=device) % width
        self.context_lens = torch.full((rows,), width, dtype=torch.long, device=device)
        self.token_request = torch.arange(rows, device=device).repeat_interleave(width)
        self.cu_seqlens = torch.arange(rows + 1, device=device) * width
        self.every = torch.arange(tokens, device=device)
        self.slots = torch.full((rows,), self.pools.sink_slot, dtype=torch.int32, device=device)
        self.page_table = torch.full(
            (rows, max_pages), self.pools.sink_page, dtype=torch.int32, device=device
        )
        # One flat buffer per KDA layer and kind, viewed per size (contiguous from the start).
        self._steps = {}
        for layer in runner.kda_layers:
            conv, rec = self.pools.kda_layer(runner.kda_ordinal[layer])
            self._steps[layer] = (
                (conv.new_zeros(tokens * conv[0].numel()), tuple(conv.shape[1:])),
                (rec.new_zeros(tokens * rec[0].numel(), dtype=torch.float32), tuple(rec.shape[1:])),
            )
        self.parallelism, self.plans = split_plans(runner, self.sizes, width)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple] = {}
        self.captured = capture
        if capture:
            self.graphs, self.outputs = capture_graphs(self._forward, self.sizes)

    @property
    def step_buffer_bytes(self) -> int:
        """Bytes of the KDA step buffers (every graph shares them)."""
        return sum(t.numel() * t.element_size() for pair in self._steps.values() for t, _ in pair)

    def steps(self, size: int) -> dict:
        """Each KDA layer's (step_conv [size, width, ...], step_states [size, width, ...])."""
        rows = size * self.width
        out = {}
        for layer, ((conv, conv_shape), (rec, rec_shape)) in self._steps.items():
            out[layer] = (
                conv[: rows * _numel(conv_shape)].view(size, self.width, *conv_shape),
                rec[: rows * _numel(rec_shape)].view(size, self.width, *rec_shape),
            )
        return out

    def _forward(self, size: int):
        tokens = size * self.width
        batch = ForwardBatch(
            seq_lens=(self.width,) * size,
            prefix_lens=None,
            cu_seqlens=self.cu_seqlens[: size + 1],
            positions=self.positions[:tokens],
            token_request=self.token_request[:tokens],
            context_lens=self.context_lens[:size],
            attn_plan=self.plans.get(size),
        )
        state = self.runner.paged_state(self.slots[:size], self.page_table[:size], self.steps(size))
        extra = {} if self.aux_layers is None else {"aux_hidden_layers": self.aux_layers}
        out = self.runner.model(
            self.ids[:tokens],
            batch,
            state,
            logits_indices=self.every[:tokens],
            check=False,
            **extra,
        )
        return out.logits, getattr(out, "aux_hidden", None)

    def fits(self, batch_size: int, prefix_lens: Sequence[int]) -> bool:
        page = self.pools.page_size
        return (
            batch_size <= self.sizes[-1] and max(prefix_lens) + self.width <= self.max_pages * page
        )

    def run(
        self,
        tokens: Sequence[Sequence[int]],
        prefix_lens: Sequence[int],
        handles: Sequence[RequestCache],
    ):
        """Row i feeds `tokens[i]` (1..width tokens) after `prefix_lens[i]` cached tokens;
        returns (logits, aux, steps, slots) as the class says, for the padded size."""
        n = len(tokens)
        width = self.width
        size = next(s for s in self.sizes if s >= n)
        if any(not 1 <= len(row) <= width for row in tokens):
            raise ValueError(f"verify rows feed 1..{width} tokens each")
        ids = torch.zeros(size, width, dtype=torch.long)
        for i, row in enumerate(tokens):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            ids[i, len(row) :] = row[-1]
        copy_into(self.ids[: size * width], ids.view(-1))
        prefix = torch.zeros(size, dtype=torch.long)
        prefix[:n] = torch.tensor(prefix_lens, dtype=torch.long)
        offsets = torch.arange(width, dtype=torch.long)
        copy_into(self.positions[: size * width], (prefix[:, None] + offsets).view(-1))
        copy_into(self.context_lens[:size], prefix + width)
        fill_tables(self.pools, self.slots[:size], self.page_table[:size], handles)
        plan = self.plans.get(size)
        if plan is not None:
            lens = [p + width for p in prefix_lens]
            fill_split_plan(plan, lens, size, self.parallelism, self.pools.page_size)
        if self.captured:
            self.graphs[size].replay()
            logits, aux = self.outputs[size]
        else:
            logits, aux = self._forward(size)
        # The auxiliary states outlive the step (a drafter keeps them): copied out.
        aux = None if aux is None else aux.clone()
        return logits, aux, self.steps(size), self.slots[:n].clone()


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count
