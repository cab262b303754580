"""`DecodeGraphs`: decode steps captured as CUDA graphs, one per padded batch size.

Graphs are captured largest first into one memory pool over static input buffers: token ids,
positions, context lengths, live KDA slots and the page table. A replay fills the buffers and
launches the graph; rows past the real batch are padding that point at the cache's sink page
and sink slot, so whatever they compute lands where nobody reads. `capture_graphs` and
`split_plans` serve `verify_graphs.VerifyGraphs` (speculative verify steps) as well.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import attrs
import torch

from tokenspeed.cache import RequestCache
from tokenspeed.cache.host_copy import copy_into
from tokenspeed.model import ForwardBatch


@attrs.frozen
class DecodeGraphConfig:
    """What a runner's `DecodeGraphs` are built for: the padded batch sizes, the page-table
    width (pages per request) and whether to capture (False: the same padded steps run eagerly,
    so that eager mode on a GPU computes the numbers the graphs do)."""

    sizes: tuple[int, ...] = attrs.field(converter=tuple)
    max_pages: int
    capture: bool = True
    # A speculating engine's verify steps feed this many tokens per row (k + 1; 0: it does not
    # speculate): they get `VerifyGraphs` of the same sizes.
    verify_width: int = attrs.field(default=0, validator=attrs.validators.in_(range(0, 5)))


def split_plans(runner, sizes: Sequence[int], queries: int) -> tuple[int, dict[int, object]]:
    """(the planner's parallelism, static split-plan buffers of the MLA decode kernel per
    graph size) for steps of `queries` tokens per row; the buffers are refilled by the planner
    before every replay ((0, {}) when the model has no MLA layers, or off CUDA: graphs run
    eagerly on a CPU only in tests, where the kernels plan for themselves)."""
    config = runner.model.config
    if not config.mla_layers or runner.device.type != "cuda":
        return 0, {}
    from tokenspeed.model.ops.mla.decode import decode_parallelism
    from tokenspeed.model.ops.mla.split_plan import SplitPlanBuffers, min_split_capacity

    device = runner.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    parallelism = decode_parallelism(sms, config.mla.num_heads, queries)
    return parallelism, {
        size: SplitPlanBuffers.allocate(size, min_split_capacity(size, parallelism), device=device)
        for size in sizes
    }


def fill_split_plan(plan, context_lens: Sequence[int], size: int, parallelism: int, page: int):
    """Refill `plan` (one size's buffers from `split_plans`) for a batch whose real rows hold
    `context_lens` tokens after the step; padding rows (up to `size`) attend to one row."""
    from tokenspeed.model.ops.mla.split_plan import plan_decode_splits

    plan_decode_splits(
        list(context_lens) + [1] * (size - len(context_lens)),
        parallelism=parallelism,
        max_batch=size,
        max_splits=plan.max_splits,
        granularity=page,
        out=plan,
    )


def fill_tables(pools, slots: torch.Tensor, page_table: torch.Tensor, handles) -> None:
    """Refill a graph's static live-slot [size] and page-table [size, max_pages] rows for the
    batch `handles` (rows past it, and columns past a request's pages: the sink)."""
    size, cols = page_table.shape
    device = slots.device
    slots.copy_(pools.live_slot_tensor(handles, num_rows=size, device=device))
    page_table.copy_(pools.page_table_tensor(handles, num_rows=size, num_cols=cols, device=device))


def capture_graphs(forward, sizes: Sequence[int]) -> tuple[dict, dict]:
    """Capture `forward(size)` for every size into one memory pool: (graphs, outputs) keyed by
    size, the outputs being the static tensors each replay rewrites."""
    # Warm up on a side stream (lazy initialisation must not happen during capture), then
    # capture largest first so smaller graphs reuse the pool's blocks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for size in sizes:
            forward(size)
    torch.cuda.current_stream().wait_stream(side)
    # No garbage collection during capture: collecting another engine runs its finalizers
    # (a copy stream's synchronize), which a capturing stream forbids: the capture fails.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    graphs, outputs = {}, {}
    try:
        pool = None
        for size in sorted(sizes, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs[size] = forward(size)
            pool = graph.pool()
            graphs[size] = graph
    finally:
        if was_enabled:
            gc.enable()
    torch.cuda.synchronize()
    return graphs, outputs


class DecodeGraphs:
    """capture=False runs the very same padded steps eagerly (same buffers, shapes and split
    plans, hence the same numbers): the engine's eager mode on a GPU."""

    def __init__(self, runner, sizes: Sequence[int], max_pages: int, capture: bool = True):
        self.runner = runner
        self.pools = runner.pools
        self.sizes = tuple(sorted(sizes))
        self.max_pages = max_pages
        device = runner.device
        rows = self.sizes[-1]
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.long, device=device)
        self.token_request = torch.arange(rows, dtype=torch.long, device=device)
        self.cu_seqlens = torch.arange(rows + 1, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), self.pools.sink_slot, dtype=torch.int32, device=device)
        self.page_table = torch.full(
            (rows, max_pages), self.pools.sink_page, dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.parallelism, self.plans = split_plans(runner, self.sizes, 1)
        self.captured = capture
        if capture:
            self.graphs, self.logits = capture_graphs(self._forward, self.sizes)

    def _forward(self, size: int) -> torch.Tensor:
        batch = ForwardBatch(
            seq_lens=(1,) * size,
            prefix_lens=None,
            cu_seqlens=self.cu_seqlens[: size + 1],
            positions=self.positions[:size],
            token_request=self.token_request[:size],
            context_lens=self.context_lens[:size],
            attn_plan=self.plans.get(size),
        )
        state = self.runner.paged_state(self.slots[:size], self.page_table[:size])
        return self.runner.model(self.ids[:size], batch, state, check=False).logits

    def fits(self, batch_size: int, prefix_lens: Sequence[int]) -> bool:
        page = self.pools.page_size
        return batch_size <= self.sizes[-1] and max(prefix_lens) < self.max_pages * page

    def run(
        self,
        tokens: Sequence[int] | torch.Tensor,
        prefix_lens: Sequence[int],
        handles: Sequence[RequestCache],
    ) -> torch.Tensor:
        """[B, vocab] logits of one decode step over B requests; `tokens` as ints or as a [B]
        device tensor (copied on the device, in stream order)."""
        n = len(tokens)
        size = next(s for s in self.sizes if s >= n)
        if isinstance(tokens, torch.Tensor):
            self.ids[:n].copy_(tokens)
        else:
            copy_into(self.ids[:n], torch.tensor(tokens, dtype=torch.long))
        self.ids[n:size].zero_()
        prefix = torch.tensor(prefix_lens, dtype=torch.long)
        copy_into(self.positions[:n], prefix)
        self.positions[n:size].zero_()
        copy_into(self.context_lens[:n], prefix + 1)
        self.context_lens[n:size].fill_(1)
        fill_tables(self.pools, self.slots[:size], self.page_table[:size], handles)
        plan = self.plans.get(size)
        if plan is not None:
            lens = [p + 1 for p in prefix_lens]
            fill_split_plan(plan, lens, size, self.parallelism, self.pools.page_size)
        if not self.captured:
            return self._forward(size)[:n].clone()
        self.graphs[size].replay()
        return self.logits[size][:n].clone()
