"""DWDP (prefill): routed expert weights stored split, every expert run on every rank's own tokens.

Over a `dwdp` group of W ranks, member i stores experts [i*E/W, (i+1)*E/W) of every MoE layer
(the layer's `experts.w1/w2/w3` become that block, marked with `mark_shard`), and attention, the
router, the shared experts and every other weight stay replicated: each rank runs its own
requests (data parallel, any number of tokens, zero included) through the whole model. Before an
MoE layer's experts run, the other members' blocks of that layer (its "remote experts") are
fetched into one of two staging buffers; the experts then read their local block in place and
the remote ones from the buffer.

Double buffering: the k-th MoE layer (in model order) uses buffer k % 2. The fetches of layers
0 and 1 are issued when the forward starts (a forward pre-hook on the model); when layer k's
experts are done with buffer k % 2, the fetch of layer k + 2 is issued into it. So while layer
k computes, layer k + 1's fetch is in flight in the other buffer, and a rank waits only for the
fetch it needs (there is no other per-layer synchronisation). `prefetch=False` fetches each
layer synchronously when its experts run (the same weights and the same math: identical
outputs). A forward hook on the model issues and waits for the fetches of any MoE layer whose
experts did not run in the step, so every member issues the same fetches in the same order
whatever its tokens.

The fetch, `fetch_remote_experts`, is one function: on CPU, W gloo broadcasts per projection
(member j sends its block; the others receive it into their buffer's slot for j), issued with
`async_op=True` on a process group of their own (created by `apply_dwdp`), so they run on
gloo's threads beside the compute and never queue behind other collectives of the step. On
GPUs it becomes copy-engine peer copies (cudaMemcpyPeerAsync / NVLink copies on a side stream,
or NCCL broadcasts on CUDA tensors as written: to be chosen by measurement); that is the only
function to swap, plus an event so that the fetch of layer k + 2 waits for layer k's kernels to
finish reading the buffer (on the CPU compute is synchronous, so issuing after layer k returns
suffices).

Communication per MoE layer and step: the remote experts' bytes, (W - 1) * E/W * 3 * I * D *
dtype bytes ("dwdp.fetch" in the CommLog; a broadcast sends what the others receive). Staging
memory: 2 buffers of one layer's remote experts (`DwdpReport.staging_bytes`,
`DwdpFetcher.staging_bytes`), allocated at the first forward on the weights' device and dtype
(so `apply_dwdp` itself allocates nothing and works on a meta model).
"""

from __future__ import annotations

from datetime import timedelta

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..model.layers.moe import Experts, MoE
from .comm import CommLog
from .dims import ParallelError
from .groups import Group, ParallelGroups, backend_for, new_groups
from .linear import shard_tensor
from .report import TransformReport, tensor_bytes
from .shards import rank_slices

FETCH = "dwdp.fetch"
PROJECTIONS = ("w1", "w2", "w3")


@attrs.frozen
class DwdpReport(TransformReport):
    """A `TransformReport` plus the staging memory: 2 buffers of one layer's remote experts."""

    staging_bytes: int = 0


def fetch_remote_experts(
    local: dict[str, torch.Tensor],
    staging: dict[str, torch.Tensor],
    group: Group,
    handle,
    async_op: bool,
) -> list:
    """Fill `staging[p]` ([(W - 1) * E/W, ...], the other members' blocks in group order) from
    every member's `local[p]` ([E/W, ...]); returns the pending works (empty when synchronous).

    Every member calls this with the same shapes in the same order. The one place the transport
    is chosen: broadcasts over `handle` (gloo on CPU tensors, NCCL on CUDA ones)."""
    works = []
    me = group.index
    for name in PROJECTIONS:
        block = local[name].shape[0]
        for src in range(group.size):
            if src == me:
                tensor = local[name]
            else:
                slot = src if src < me else src - 1
                tensor = staging[name][slot * block : (slot + 1) * block]
            work = dist.broadcast(tensor, src=group.ranks[src], group=handle, async_op=async_op)
            if async_op:
                works.append(work)
    return works


class DwdpFetcher:
    """The fetch schedule of one model's MoE layers on one rank (see the module docstring)."""

    def __init__(
        self,
        layers: list[Experts],
        group: Group,
        handle,
        log: CommLog | None,
        prefetch: bool,
    ):
        self.layers = layers
        self.group = group
        self.handle = handle
        self.log = log
        self.prefetch = prefetch
        self.staging: list[dict[str, torch.Tensor]] | None = None
        self.pending: dict[int, list] = {}  # layer position -> works in flight
        self.holder: list[int | None] = [None, None]  # the layer each buffer holds (fetched)
        self.issued = 0  # fetches issued this step (for positions 0 .. issued - 1)
        self.active = False  # between begin() and finish()

    @property
    def remote_experts(self) -> int:
        e = self.layers[0].w1.shape[0] if self.layers else 0
        return (self.group.size - 1) * e

    def _shape(self, name: str) -> tuple[int, ...]:
        return (self.remote_experts, *getattr(self.layers[0], name).shape[1:])

    @property
    def layer_fetch_bytes(self) -> int:
        """Bytes of one layer's remote experts (what one fetch brings in)."""
        if not self.layers:
            return 0
        first = self.layers[0]
        size = first.w1.element_size()
        return sum(torch.Size(self._shape(n)).numel() for n in PROJECTIONS) * size

    @property
    def staging_bytes(self) -> int:
        """The two staging buffers: 2 layers' remote experts."""
        return 2 * self.layer_fetch_bytes

    def _buffers(self) -> list[dict[str, torch.Tensor]]:
        if self.staging is None:
            first = self.layers[0]
            self.staging = [
                {
                    n: torch.empty(
                        self._shape(n), dtype=getattr(first, n).dtype, device=first.w1.device
                    )
                    for n in PROJECTIONS
                }
                for _ in range(2)
            ]
        return self.staging

    def _issue(self, k: int, async_op: bool) -> None:
        """Start the fetch of the k-th MoE layer into buffer k % 2 (the fetch that used the
        buffer before, two layers back, is waited for first)."""
        buffer = k % 2
        previous = self.holder[buffer]
        if previous is not None:
            self._wait(previous)
        experts = self.layers[k]
        local = {n: getattr(experts, n).detach() for n in PROJECTIONS}
        works = fetch_remote_experts(
            local, self._buffers()[buffer], self.group, self.handle, async_op
        )
        if self.log is not None:
            self.log.record(FETCH, self.layer_fetch_bytes)
        self.pending[k] = works
        self.holder[buffer] = k
        self.issued = k + 1

    def _wait(self, k: int) -> None:
        for work in self.pending.pop(k, ()):
            work.wait()

    def begin(self) -> None:
        """A forward starts: finish anything a failed step left, then prefetch layers 0, 1."""
        self.finish()
        self.active = True
        if self.prefetch:
            for k in range(min(2, len(self.layers))):
                self._issue(k, async_op=True)

    def weights(self, k: int) -> dict[str, torch.Tensor]:
        """The k-th MoE layer's remote experts, fetched (issuing any fetch the schedule owes
        first, in order, so every member issues the same sequence)."""
        if not self.active or (self.issued > k and self.holder[k % 2] != k):
            # A step that did not go through the model's hooks (a layer called directly).
            self.begin()
        while self.issued <= k:
            self._issue(self.issued, async_op=self.prefetch)
        self._wait(k)
        return self._buffers()[k % 2]

    def done(self, k: int) -> None:
        """The k-th MoE layer's experts no longer read its buffer: prefetch layer k + 2."""
        if self.prefetch and k + 2 < len(self.layers) and self.issued == k + 2:
            self._issue(k + 2, async_op=True)

    def finish(self) -> None:
        """Issue the fetches of layers that did not run this step and wait for all."""
        while self.active and self.issued < len(self.layers):
            self._issue(self.issued, async_op=self.prefetch)
        self.active = False
        for k in list(self.pending):
            self._wait(k)
        self.holder = [None, None]
        self.issued = 0


class DwdpExperts(Experts):
    """`Experts` holding one block of the stack; the others come from the fetcher's staging
    buffer (set by `apply_dwdp` by class swap; `dwdp_fetcher`, `dwdp_position`, `dwdp_block`
    are plain attributes)."""

    dwdp_fetcher: DwdpFetcher
    dwdp_position: int
    dwdp_block: tuple[int, int]  # [start, stop) of the full stack held here

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        fetcher, k = self.dwdp_fetcher, self.dwdp_position
        remote = fetcher.weights(k)
        out = routed_experts_split(
            x, weights, ids, (self.w1, self.w2, self.w3), remote, self.dwdp_block, self.glu
        )
        fetcher.done(k)
        return out

    def kernel_tensors(self):
        raise NotImplementedError(
            "DWDP experts hold one block of the stack: the fused MoE kernels need an "
            "ExpertWeights over the local block and the staging buffer (not written yet)"
        )

    kernel_weights = kernel_tensors


def routed_experts_split(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    local: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    remote: dict[str, torch.Tensor],
    block: tuple[int, int],
    glu,
) -> torch.Tensor:
    """`ops.moe.reference.routed_experts` over a stack stored in two parts: experts
    [block[0], block[1]) at rows of `local`, the others (in order, skipping the block) at rows
    of `remote`. The same operations in the same order on the same values: bit-identical."""
    start, stop = block
    w1, w2, w3 = local
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        if start <= expert < stop:
            row, a, b, c = expert - start, w1, w2, w3
        else:
            row = expert if expert < start else expert - (stop - start)
            a, b, c = remote["w1"], remote["w2"], remote["w3"]
        token, slot = (ids == expert).nonzero(as_tuple=True)
        h = x[token]
        y = glu(h @ a[row].t(), h @ c[row].t()) @ b[row].t()
        out.index_add_(0, token, y.float() * weights[token, slot].unsqueeze(-1))
    return out.to(x.dtype)


def check_dwdp(model: nn.Module, groups: ParallelGroups) -> None:
    """Refuse what `apply_dwdp` cannot transform (see its preconditions), changing nothing."""
    size = groups["dwdp"].size
    if size == 1:
        return
    for prefix, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        experts = moe.experts
        if type(experts) is not Experts:
            raise ParallelError(
                f"apply_dwdp needs dense Experts, found {type(experts).__name__} at "
                f"{prefix}.experts (MXFP4 and already split experts are not supported)"
            )
        marked = sorted(rank_slices(experts))
        if marked:
            raise ParallelError(
                f"apply_dwdp: {prefix}.experts {marked} are already sharded by another "
                "transform (apply_tp or apply_dep came first?)"
            )
        if experts.w1.shape[0] % size:
            raise ParallelError(
                f"dwdp={size} does not divide the routed experts ({experts.w1.shape[0]}) of "
                f"{prefix}"
            )


def apply_dwdp(
    model: nn.Module,
    groups: ParallelGroups,
    *,
    log: CommLog | None = None,
    prefetch: bool = True,
    timeout: timedelta | None = None,
) -> DwdpReport:
    """Store every MoE layer's routed experts split over `groups["dwdp"]` and fetch the remote
    ones ahead of each layer (see the module docstring).

    Preconditions: called collectively, in the same order, by every rank of the world (it
    creates the fetch process groups: torch.distributed needs every rank for that); the MoE
    layers hold dense `Experts` (not MXFP4) and no other transform has split them (not with
    `ep`, which ParallelDims refuses, nor `tep`); the experts run through their module (the torch
    path: the fused CUDA MoE path refuses DWDP experts loudly); every rank calls the model's
    forward every step, with an empty batch when it has no tokens (the fetches happen in the
    forward). Each rank runs its own requests; nothing else is communicated.

    Communicates per MoE layer and step: the layer's remote experts, (W - 1)/W of its routed
    expert bytes ("dwdp.fetch"). `timeout` bounds the fetch group's collectives (default: the
    groups' own, `ParallelGroups.timeout`).
    """
    check_dwdp(model, groups)
    group = groups["dwdp"]
    before = tensor_bytes(model)
    if group.size == 1:
        return DwdpReport("dwdp", before, before, staging_bytes=0)
    layers = [m.experts for m in model.modules() if isinstance(m, MoE)]
    size, index = group.size, group.index
    num = layers[0].w1.shape[0] if layers else 0
    # The fetch group: every rank of the world takes part in creating each one.
    timeout = groups.timeout if timeout is None else timeout
    handle = new_groups(size, backend_for(groups.device), timeout).handle
    block = num // size
    start, stop = index * block, (index + 1) * block
    fetcher = DwdpFetcher(layers, group, handle, log, prefetch)
    for position, experts in enumerate(layers):
        for name in PROJECTIONS:
            shard_tensor(experts, name, dim=0, start=start, stop=stop)
        experts.__class__ = DwdpExperts
        experts.dwdp_fetcher = fetcher
        experts.dwdp_position = position
        experts.dwdp_block = (start, stop)
    if layers:
        model.register_forward_pre_hook(lambda module, args: fetcher.begin())
        model.register_forward_hook(lambda module, args, out: fetcher.finish())
    return DwdpReport("dwdp", before, tensor_bytes(model), staging_bytes=fetcher.staging_bytes)
