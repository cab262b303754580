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
outputs). A forward hook on the model waits for every fetch still in flight when the step
ends.

Transports (`apply_dwdp(transport=...)`):

- "collective" (the default, CPU or CUDA; the default because it needs nothing of the
  weights at apply time: it works on a meta model, before per-rank loading):
  `fetch_remote_experts`, broadcasts from each owner, described below. A broadcast needs its
  owner, so the members are coupled: every member must run as many forwards as the others (an
  idle one runs empty forwards), and the end-of-step hook also issues the fetches of any MoE
  layer whose experts did not run, so every member issues the same fetches in the same order.
- "shared_memory" (CPU tensors only): one-sided. At apply time each member copies its block of
  every MoE layer into one named POSIX shared-memory block (`multiprocessing.shared_memory`;
  the name is a random token that the group's first member draws and broadcasts once, plus the
  member's index), its parameters become views of that block (no second copy), every member
  maps every peer's block, and once all have mapped them each owner unlinks its name (the
  mappings stay valid; nothing is left in /dev/shm whatever happens to the processes later).
  A fetch is then a plain copy from the peers' mapped tensors into the staging buffer, done on
  one worker thread per model (`SharedExperts`, stopped when the model is garbage-collected),
  so layer k + 1's copy overlaps layer k's compute; `prefetch=False` copies in the caller's
  thread. No collective in the forward: members run any number of forwards, independently,
  and a layer that does not run is not fetched. The apply-time setup (one token broadcast and
  three barriers over the dwdp group) is the only communication. It needs the weights in place
  (not a meta model: load first, then apply). CUDA experts are refused: their one-sided
  transport is copy-engine peer copies (not written yet).

The collective fetch, `fetch_remote_experts`: on CPU, W gloo broadcasts per projection (member
j sends its block; the others receive it into their buffer's slot for j), issued with
`async_op=True` on a process group of their own (created by `apply_dwdp`), so they run on
gloo's threads beside the compute and never queue behind other collectives of the step. On
GPUs it becomes copy-engine peer copies (cudaMemcpyPeerAsync / NVLink copies on a side stream,
or NCCL broadcasts on CUDA tensors as written: to be chosen by measurement); that is the only
function to swap, plus an event so that the fetch of layer k + 2 waits for layer k's kernels to
finish reading the buffer (on the CPU compute is synchronous, so issuing after layer k returns
suffices).

Communication per MoE layer and step: the remote experts' bytes, (W - 1) * E/W * 3 * I * D *
dtype bytes ("dwdp.fetch" in the CommLog; a broadcast sends what the others receive; with
shared memory, the bytes copied from the peers' blocks, per MoE layer fetched). Staging
memory: 2 buffers of one layer's remote experts (`DwdpReport.staging_bytes`,
`DwdpFetcher.staging_bytes`), allocated at the first forward on the weights' device and dtype
(so `apply_dwdp` itself allocates nothing and works on a meta model).
"""

from __future__ import annotations

import secrets
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ..model.layers.moe import Experts, MoE, grouped_experts
from ..model.ops import dispatch
from .comm import CommLog
from .dims import ParallelError
from .groups import Group, ParallelGroups, backend_for, new_groups
from .linear import as_parameter, shard_tensor
from .report import TransformReport, tensor_bytes
from .shards import mark_shard, rank_slices
from .shm import (
    SharedBlock,
    aligned,
    attach_block,
    block_tensor,
    create_block,
    unlink_block,
    view_as,
)

FETCH = "dwdp.fetch"
PROJECTIONS = ("w1", "w2", "w3")
TRANSPORTS = ("collective", "shared_memory")
# What bounds a wait for a shared-memory copy when neither `apply_dwdp(timeout=)` nor the
# groups give one (a copy of one layer's experts takes milliseconds: this only catches a bug).
FETCH_TIMEOUT = timedelta(minutes=5)


@attrs.frozen
class DwdpReport(TransformReport):
    """A `TransformReport` plus the staging memory: 2 buffers of one layer's remote experts."""

    staging_bytes: int = 0
    transport: str = "collective"


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


class _CopyWork:
    """A copy running on the worker thread; `wait` re-raises its error, bounded by `timeout`."""

    def __init__(self, future: Future, timeout: float):
        self.future, self.timeout = future, timeout

    def wait(self) -> None:
        self.future.result(timeout=self.timeout)


class SharedExperts:
    """One model's experts in shared memory, on one member (made by `apply_dwdp` with
    `transport="shared_memory"`; see the module docstring).

    `own` is this member's block (its expert parameters are views of `base`, the whole block as
    uint8), `peers` the other members' blocks in group order, `remote[k][p]` the peers'
    tensors of projection p of the k-th MoE layer (in group order, skipping this member: the
    staging buffer's slot order). `names` are the blocks' names, all unlinked by the time
    `apply_dwdp` returns. Fetches run on one worker thread (`executor`, its
    thread started at the first fetch), shut down when the model is garbage-collected."""

    def __init__(
        self,
        token: str,
        group: Group,
        own: SharedBlock,
        base: torch.Tensor,
        timeout: timedelta,
    ):
        self.token = token
        self.group = group
        self.names = tuple(block_name(token, i) for i in range(group.size))
        self.own = own
        self.base = base
        self.peers: list[SharedBlock] = []
        self.remote: list[dict[str, list[torch.Tensor]]] = []
        self.timeout = timeout.total_seconds()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dwdp-fetch")

    def fetch(self, k: int, staging: dict[str, torch.Tensor], async_op: bool) -> list:
        """Copy the k-th MoE layer's remote experts into `staging` (on the worker thread when
        `async_op`: returns its work; else here, returning nothing)."""
        layer = self.remote[k]

        def copy() -> None:
            for name in PROJECTIONS:
                for slot, tensor in enumerate(layer[name]):
                    rows = tensor.shape[0]
                    staging[name][slot * rows : (slot + 1) * rows].copy_(tensor)

        if not async_op:
            copy()
            return []
        return [_CopyWork(self.executor.submit(copy), self.timeout)]


def block_name(token: str, index: int) -> str:
    """The shared-memory name of member `index`'s block in the run `token` (short: some systems
    allow 31 characters)."""
    return f"tsdwdp_{token}_{index}"


def _draw_token(group: Group) -> str:
    """A random token drawn by the group's first member and broadcast to the others."""
    box = [secrets.token_hex(8) if group.index == 0 else None]
    dist.broadcast_object_list(box, src=group.ranks[0], group=group.handle)
    return box[0]


def _check_shared_memory(layers: list[Experts]) -> None:
    for experts in layers:
        for name in PROJECTIONS:
            device = getattr(experts, name).device
            if device.type == "cuda":
                raise ParallelError(
                    "apply_dwdp(transport='shared_memory') maps CPU tensors; CUDA experts need "
                    "the one-sided peer-copy transport (copy-engine cudaMemcpyPeerAsync, not "
                    "written yet): use transport='collective' (NCCL broadcasts) meanwhile"
                )
            if device.type != "cpu":
                raise ParallelError(
                    f"apply_dwdp(transport='shared_memory') needs the experts' weights on the "
                    f"CPU, in place (found {device.type}): load the weights, then apply, or use "
                    "transport='collective' (it works on a meta model)"
                )


def share_experts(
    layers: list[Experts], group: Group, start: int, stop: int, timeout: timedelta
) -> SharedExperts:
    """Move this member's block [start, stop) of every layer into its shared block, map the
    peers' blocks and unlink its name (collective over `group`: one broadcast, three barriers)."""
    token = _draw_token(group)
    # The block's layout, the same on every member: each projection of each layer in order.
    layout, offset = [], 0
    for experts in layers:
        entry = {}
        for name in PROJECTIONS:
            weight = getattr(experts, name)
            shape = (stop - start, *weight.shape[1:])
            entry[name] = (offset, shape, weight.dtype)
            offset += aligned(torch.Size(shape).numel() * weight.element_size())
        layout.append(entry)
    own = create_block(block_name(token, group.index), max(offset, 1))
    try:
        base = block_tensor(own)
        shared = SharedExperts(token, group, own, base, timeout)
        for experts, entry in zip(layers, layout, strict=True):
            for name, (at, shape, dtype) in entry.items():
                old = getattr(experts, name)
                mark_shard(experts, name, dim=0, start=start, stop=stop)
                view = view_as(base, at, shape, dtype)
                view.copy_(old.detach().narrow(0, start, stop - start))
                setattr(experts, name, as_parameter(view, old))
        dist.barrier(group=group.handle)  # every block exists and holds its weights
        for index in range(group.size):
            if index != group.index:
                shared.peers.append(attach_block(shared.names[index]))
        bases = [block_tensor(peer) for peer in shared.peers]
        shared.remote = [
            {
                name: [view_as(b, at, shape, dtype) for b in bases]
                for name, (at, shape, dtype) in entry.items()
            }
            for entry in layout
        ]
        dist.barrier(group=group.handle)  # every member mapped every block
    finally:
        unlink_block(own)  # the mappings stay; nothing is left in /dev/shm
    dist.barrier(group=group.handle)  # every name is gone when apply_dwdp returns anywhere
    return shared


class DwdpFetcher:
    """The fetch schedule of one model's MoE layers on one rank (see the module docstring)."""

    def __init__(
        self,
        layers: list[Experts],
        group: Group,
        handle,
        log: CommLog | None,
        prefetch: bool,
        shared: SharedExperts | None = None,
    ):
        self.layers = layers
        self.group = group
        self.handle = handle
        self.log = log
        self.prefetch = prefetch
        self.shared = shared  # the one-sided transport; None: the collective one
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
        if self.shared is not None:
            works = self.shared.fetch(k, self._buffers()[buffer], async_op)
        else:
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
        """Wait for every fetch in flight; the collective transport first issues the fetches
        of layers that did not run this step (the peers' broadcasts need this member)."""
        while self.active and self.shared is None and self.issued < len(self.layers):
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
        if dispatch.fused_moe(x) and x.shape[0]:
            out = self._forward_fused(x, weights, ids, remote)
        else:
            out = routed_experts_split(
                x, weights, ids, (self.w1, self.w2, self.w3), remote, self.dwdp_block, self.glu
            )
        fetcher.done(k)
        return out

    def _forward_fused(self, x, weights, ids, remote: dict[str, torch.Tensor]) -> torch.Tensor:
        """The grouped expert kernels over the two parts of the stack: the block held here,
        then the staging buffer (the others, in order), each skipping the other's slots (-1)."""
        from ..model.ops.moe.experts import ExpertWeights

        start, stop = self.dwdp_block
        inside = (ids >= start) & (ids < stop)
        local_ids = torch.where(inside, ids - start, -1).to(torch.int32)
        remote_ids = torch.where(ids < start, ids, ids - (stop - start))
        remote_ids = torch.where(inside, -1, remote_ids).to(torch.int32)
        here = ExpertWeights(format="dense", w1=self.w1, w2=self.w2, w3=self.w3)
        staged = ExpertWeights(format="dense", w1=remote["w1"], w2=remote["w2"], w3=remote["w3"])
        a = grouped_experts(self, x, weights, local_ids, here)
        b = grouped_experts(self, x, weights, remote_ids, staged)
        return (a.float() + b.float()).to(x.dtype)

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
    transport: str = "collective",
) -> DwdpReport:
    """Store every MoE layer's routed experts split over `groups["dwdp"]` and fetch the remote
    ones ahead of each layer (see the module docstring).

    Preconditions: called collectively, in the same order, by every rank of the world (the
    collective transport creates the fetch process groups: torch.distributed needs every rank
    for that; the shared-memory one talks over the dwdp group only); the MoE layers hold dense
    `Experts` (not MXFP4) and no other transform has split them (not with `ep`, which
    ParallelDims refuses, nor `tep`); the experts run through their module (the torch path:
    the fused CUDA MoE path refuses DWDP experts loudly). Each rank runs its own requests.

    transport: "collective" (default): broadcasts from the owners, so every rank calls the
    model's forward every step, with an empty batch when it has no tokens (the fetches happen
    in the forward); works on a meta model. "shared_memory": one-sided copies from the peers'
    shared-memory blocks (CPU weights in place; CUDA refused): nothing is communicated after
    apply, ranks run any number of forwards independently; the local experts live in this
    rank's (already unlinked) block.

    Communicates per MoE layer and step: the layer's remote experts, (W - 1)/W of its routed
    expert bytes ("dwdp.fetch"). `timeout` bounds the fetch group's collectives, or the waits
    for the shared-memory copies (default: the groups' own, `ParallelGroups.timeout`).
    """
    if transport not in TRANSPORTS:
        raise ParallelError(f"apply_dwdp: transport {transport!r} is not one of {TRANSPORTS}")
    check_dwdp(model, groups)
    group = groups["dwdp"]
    before = tensor_bytes(model)
    if group.size == 1:
        return DwdpReport("dwdp", before, before, staging_bytes=0)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        # The one-device fused MoE reads every expert from one stack: DWDP experts hold one
        # block and stage the others, so the routed step goes through `DwdpExperts.forward`.
        moe.fused_routed = False
    layers = [m.experts for m in moes]
    if transport == "shared_memory":
        _check_shared_memory(layers)
    size, index = group.size, group.index
    num = layers[0].w1.shape[0] if layers else 0
    timeout = groups.timeout if timeout is None else timeout
    block = num // size
    start, stop = index * block, (index + 1) * block
    if transport == "shared_memory":
        handle, shared = None, None
        if layers:
            shared = share_experts(layers, group, start, stop, timeout or FETCH_TIMEOUT)
            # The worker thread goes with the model (the finalizer holds no reference to it).
            weakref.finalize(model, shared.executor.shutdown, wait=False, cancel_futures=True)
    else:
        # The fetch group: every rank of the world takes part in creating each one.
        handle = new_groups(size, backend_for(groups.device), timeout).handle
        shared = None
        for experts in layers:
            for name in PROJECTIONS:
                shard_tensor(experts, name, dim=0, start=start, stop=stop)
    fetcher = DwdpFetcher(layers, group, handle, log, prefetch, shared)
    for position, experts in enumerate(layers):
        experts.__class__ = DwdpExperts
        experts.dwdp_fetcher = fetcher
        experts.dwdp_position = position
        experts.dwdp_block = (start, stop)
    if layers:
        model.register_forward_pre_hook(lambda module, args: fetcher.begin())
        model.register_forward_hook(lambda module, args, out: fetcher.finish())
    return DwdpReport(
        "dwdp",
        before,
        tensor_bytes(model),
        staging_bytes=fetcher.staging_bytes,
        transport=transport,
    )
