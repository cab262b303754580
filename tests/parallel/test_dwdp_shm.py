"""DWDP's one-sided shared-memory transport on CPU ranks: logits bit-identical to the collective
transport and to the single-process model (prefetch on and off), ranks running different
numbers of forwards (none at all included) without any collective, no name left in /dev/shm
after apply, the local experts living in the rank's shared block, and the worker thread gone
with the model. gloo is used at apply time only."""

from __future__ import annotations

import copy
import gc
import os
import threading
import weakref
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel.comm import CommLog
from tokenspeed.parallel.dims import KINDS, ParallelDims, ParallelError
from tokenspeed.parallel.dwdp import FETCH, PROJECTIONS, DwdpExperts, DwdpFetcher, apply_dwdp
from tokenspeed.parallel.groups import Group, ParallelGroups
from tokenspeed.parallel.shm import attach_block

from .harness import run_ranks

SHM = "/dev/shm"
# Lockstep part: each rank's (prefill lengths, extension lengths); the last rank of 4 is idle.
REQUESTS = [([5, 3], [2, 4]), ([7], [6]), ([2, 4, 1], [3, 1, 2]), ([], [])]
# Independent part: forwards each rank runs on its own, never agreeing with the others.
FORWARDS = {2: [3, 1], 4: [3, 1, 0, 2]}


def _model():
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)


def _steps(model, prefill, extend, seed):
    gen = torch.Generator().manual_seed(seed)
    out, state, prefix = [], model.empty_state(len(prefill)), [0] * len(prefill)
    for lens in (prefill, extend):
        ids = torch.randint(3, 512, (sum(lens),), generator=gen)
        result = model(ids, ForwardBatch.build(lens, prefix), state)
        out.append(result.logits)
        state, prefix = result.state, [p + n for p, n in zip(prefix, lens, strict=True)]
    return out


def _prefill(model, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (sum(lens),), generator=gen)
    return model(ids, ForwardBatch.build(lens), model.empty_state(len(lens))).logits


def _shared(model):
    return next(m for m in model.modules() if isinstance(m, DwdpExperts)).dwdp_fetcher.shared


def _fetch_threads() -> int:
    return sum(t.name.startswith("dwdp-fetch") for t in threading.enumerate())


def _in_block(model) -> bool:
    """Every local expert parameter is a view of the rank's shared block (its storage)."""
    base = _shared(model).base
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
    params = [
        getattr(m, n) for m in model.modules() if isinstance(m, DwdpExperts) for n in PROJECTIONS
    ]
    return bool(params) and all(
        p.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and lo <= p.data_ptr()
        and p.data_ptr() + p.numel() * p.element_size() <= hi
        for p in params
    )


def _leftovers(token: str) -> list[str]:
    return [n for n in os.listdir(SHM) if token in n]


def _shm_ranks(rank, world):
    prefill, extend = REQUESTS[rank]
    base = _model()
    want = _steps(base, prefill, extend, seed=rank)
    groups = ParallelGroups.build(
        ParallelDims(world_size=world, dwdp=world), timeout=timedelta(seconds=60)
    )
    collective = copy.deepcopy(base)
    apply_dwdp(collective, groups, transport="collective")
    got_collective = _steps(collective, prefill, extend, seed=rank)
    del collective
    out = dict(runs={}, tokens=[sum(prefill), sum(extend)])
    threads_before = _fetch_threads()
    for prefetch in (True, False):
        model = copy.deepcopy(base)
        log = CommLog()
        report = apply_dwdp(model, groups, log=log, prefetch=prefetch, transport="shared_memory")
        shared = _shared(model)
        left = _leftovers(shared.token)
        gone = []
        for name in shared.names:
            try:
                attach_block(name).close()
            except FileNotFoundError:
                gone.append(name)
        got = _steps(model, prefill, extend, seed=rank)
        threads_during = _fetch_threads()
        alive = weakref.ref(model)
        run = dict(
            token=shared.token,
            names=shared.names,
            left=left,
            gone=gone,
            in_block=_in_block(model),
            block_bytes=shared.own.size,
            report=(report.weight_bytes_before, report.weight_bytes_after, report.transport),
            calls=log.calls[FETCH],
            equal_collective=all(
                torch.equal(a, b) for a, b in zip(got, got_collective, strict=True)
            ),
            errors=[
                float((a - b).abs().max()) if a.numel() else 0.0
                for a, b in zip(got, want, strict=True)
            ],
            logits=got,
            threads_during=threads_during - threads_before,
        )
        del model, shared
        gc.collect()
        run["collected"] = alive() is None
        for _ in range(100):  # the worker thread notices the shutdown within moments
            if _fetch_threads() == threads_before:
                break
            threading.Event().wait(0.05)
        run["threads_after"] = _fetch_threads() - threads_before
        out["runs"][prefetch] = run
    # Independent forwards: no collective after apply; a rank with none returns at once (its
    # process exits while the others still copy from its block).
    model = copy.deepcopy(base)
    apply_dwdp(model, groups, transport="shared_memory")
    errors = []
    for step in range(FORWARDS[world][rank]):
        lens = [3 + rank, 2 + step]
        got = _prefill(model, lens, seed=100 * rank + step)
        errors.append(float((got - _prefill(base, lens, seed=100 * rank + step)).abs().max()))
    out["independent"] = errors
    return out


@pytest.mark.skipif(not os.path.isdir(SHM), reason="needs /dev/shm (Linux)")
@pytest.mark.parametrize("world", [2, 4])
def test_shared_memory_dwdp_is_one_sided_and_exact(world):
    results = run_ranks(_shm_ranks, world, timeout=300, fresh=True)
    config = get_preset("tiny")
    layers = sum(kind == "moe" for kind in config.mlp_kinds)
    moe = config.moe
    block = moe.num_experts // world
    expert_bytes = 3 * moe.expert_intermediate_size * moe.latent_size * 4
    for prefetch in (True, False):
        tokens = {r["runs"][prefetch]["token"] for r in results}
        assert len(tokens) == 1  # drawn once, shared by the group
        for rank, res in enumerate(results):
            run = res["runs"][prefetch]
            assert run["left"] == [], (rank, run["left"])  # nothing in /dev/shm after apply
            assert run["gone"] == list(run["names"]) and len(run["names"]) == world
            assert run["in_block"], rank
            assert run["block_bytes"] >= layers * block * expert_bytes
            before, after, transport = run["report"]
            assert transport == "shared_memory"
            assert before - after == layers * (world - 1) * block * expert_bytes
            assert run["equal_collective"], rank  # bit-identical to the collective transport
            assert max(run["errors"]) <= 2e-5, (rank, run["errors"])
            assert run["calls"] == 2 * layers  # every MoE layer copied once per forward
            assert run["threads_during"] == (1 if prefetch else 0)
            assert run["collected"] and run["threads_after"] == 0, rank
    for rank, res in enumerate(results):
        on, off = res["runs"][True]["logits"], res["runs"][False]["logits"]
        assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True)), rank
        assert len(res["independent"]) == FORWARDS[world][rank]
        assert max(res["independent"], default=0.0) <= 2e-5, (rank, res["independent"])
    assert {r["runs"][True]["token"] for r in results}.isdisjoint(
        {r["runs"][False]["token"] for r in results}
    )
    if world == 4:
        assert results[-1]["tokens"] == [0, 0]


def _groups_without_handles(world: int) -> ParallelGroups:
    dims = ParallelDims(world_size=world, dwdp=world)
    groups = {k: Group(None, tuple(range(getattr(dims, k))), 0) for k in KINDS}
    return ParallelGroups(dims, 0, torch.device("cpu"), groups, timedelta(seconds=7))


def test_shared_memory_refuses_what_it_cannot_map():
    with torch.device("meta"):
        meta = KimiForCausalLM(get_preset("tiny"))
    with pytest.raises(ParallelError, match="on the CPU, in place .*found meta"):
        apply_dwdp(meta, _groups_without_handles(2), transport="shared_memory")
    assert not any(isinstance(m, DwdpExperts) for m in meta.modules())
    with pytest.raises(ParallelError, match="transport 'nvlink' is not one of"):
        apply_dwdp(_model(), _groups_without_handles(2), transport="nvlink")
    from tokenspeed.parallel.dwdp import _check_shared_memory

    cuda = SimpleNamespace(**{n: SimpleNamespace(device=torch.device("cuda")) for n in PROJECTIONS})
    with pytest.raises(ParallelError, match="CUDA experts need the one-sided peer-copy"):
        _check_shared_memory([cuda])


class _Shared:
    """A fake one-sided transport recording what the fetcher asks of it."""

    def __init__(self, events):
        self.events = events

    def fetch(self, k, staging, async_op):
        self.events.append(("issue", k, "async" if async_op else "sync"))
        return [SimpleNamespace(wait=lambda: self.events.append(("wait", k)))] if async_op else []


def test_one_sided_step_fetches_only_the_layers_that_run():
    """Single process: with a one-sided transport, the end of a step waits for what is in
    flight and issues nothing for the layers that did not run (no peer needs it)."""
    model = _model()
    layers = [m.experts for m in model.modules() if hasattr(m, "experts")][:4]
    events = []
    fetcher = DwdpFetcher(layers, Group(None, (0, 1), 0), None, None, True, _Shared(events))
    fetcher.begin()
    fetcher.weights(0)
    fetcher.done(0)
    fetcher.finish()  # layers 1 (prefetched), 3 did not run; 2 was prefetched after layer 0
    assert events == [
        ("issue", 0, "async"),
        ("issue", 1, "async"),
        ("wait", 0),
        ("issue", 2, "async"),
        ("wait", 1),
        ("wait", 2),
    ]
    events.clear()
    fetcher.prefetch = False
    fetcher.begin()
    fetcher.weights(0)
    fetcher.done(0)
    fetcher.finish()
    assert events == [("issue", 0, "sync")]
