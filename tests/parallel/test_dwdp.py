"""DWDP on CPU ranks: routed experts stored split, fetched ahead into two staging buffers; every
rank's logits for its own requests equal the single-process model's, identical with prefetch
on and off, with uneven tokens per rank (an idle rank once the model runs empty forwards)."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel.comm import CommLog
from tokenspeed.parallel.dims import ParallelDims
from tokenspeed.parallel.dwdp import FETCH, DwdpExperts, apply_dwdp
from tokenspeed.parallel.groups import ParallelGroups
from tokenspeed.parallel.shards import rank_slices

from .harness import run_ranks

# Requests of each rank: (prefill lengths, then extension lengths over those prefixes).
REQUESTS = [([5, 3], [2, 4]), ([7], [6]), ([2, 4, 1], [3, 1, 2]), ([], [])]


def _model():
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)


def empty_forward_works() -> bool:
    """Whether the model runs a step with no requests (the idle-rank case needs it)."""
    try:
        model = _model()
        out = model(torch.zeros(0, dtype=torch.long), ForwardBatch.build([]), model.empty_state(0))
    except Exception:
        return False
    return tuple(out.logits.shape) == (0, model.config.vocab_size)


def _requests(rank, world, idle):
    prefill, extend = REQUESTS[rank]
    if rank == world - 1 and not idle:
        prefill, extend = [1], [2]  # the last rank idles only once empty forwards run
    return prefill, extend


def _steps(model, prefill, extend, seed):
    """Logits of a prefill and an extension of the same requests."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    state = model.empty_state(len(prefill))
    prefix = [0] * len(prefill)
    for lens in (prefill, extend):
        ids = torch.randint(3, 512, (sum(lens),), generator=gen)
        result = model(ids, ForwardBatch.build(lens, prefix), state)
        out.append(result.logits)
        state, prefix = result.state, [p + n for p, n in zip(prefix, lens, strict=True)]
    return out


def _dwdp(rank, world, idle):
    base = _model()
    prefill, extend = _requests(rank, world, idle)
    want = _steps(base, prefill, extend, seed=rank)
    groups = ParallelGroups.build(ParallelDims(world_size=world, dwdp=world))
    results = {}
    for prefetch in (True, False):
        model = copy.deepcopy(base)
        log = CommLog()
        report = apply_dwdp(model, groups, log=log, prefetch=prefetch)
        got = _steps(model, prefill, extend, seed=rank)
        results[prefetch] = dict(
            logits=got,
            sent=log.sent[FETCH],
            calls=log.calls[FETCH],
            report=(report.weight_bytes_before, report.weight_bytes_after, report.staging_bytes),
            shards=sorted(
                (name, (s.dim, s.start, s.stop)) for name, s in rank_slices(model).items()
            ),
            shapes={tuple(m.w1.shape) for m in model.modules() if isinstance(m, DwdpExperts)},
        )
    on, off = results[True], results[False]
    # A forward in which this rank's MoE layers never run (as an empty forward that skips the
    # layers would): its hooks still issue every fetch, in order, so the peers' forward works.
    model = copy.deepcopy(base)
    apply_dwdp(model, groups)
    if rank == world - 1:
        fetcher = next(m for m in model.modules() if isinstance(m, DwdpExperts)).dwdp_fetcher
        for _ in range(2):  # as many steps as the peers' _steps
            fetcher.begin()
            fetcher.finish()
        skipped = 0.0
    else:
        skipped = float((_steps(model, prefill, extend, seed=rank)[1] - want[1]).abs().max())
    return dict(
        skipped=skipped,
        identical=all(torch.equal(a, b) for a, b in zip(on["logits"], off["logits"], strict=True)),
        errors=[
            float((a - b).abs().max()) if a.numel() else 0.0
            for a, b in zip(on["logits"], want, strict=True)
        ],
        tokens=[sum(prefill), sum(extend)],
        on=on,
        off=off,
    )


@pytest.mark.parametrize("world", [2, 4])
def test_dwdp_matches_single_process_with_and_without_prefetch(world):
    idle = world == 4 and empty_forward_works()
    results = run_ranks(_dwdp, world, idle, timeout=240)
    config = get_preset("tiny")
    moe = config.moe
    layers = sum(kind == "moe" for kind in config.mlp_kinds)
    block = moe.num_experts // world
    expert_bytes = 3 * moe.expert_intermediate_size * moe.latent_size * 4
    fetch = (world - 1) * block * expert_bytes  # one layer's remote experts
    for rank, res in enumerate(results):
        assert res["identical"], rank
        assert res["skipped"] <= 2e-5, rank
        assert max(res["errors"]) <= 2e-5, (rank, res["errors"])
        for run in (res["on"], res["off"]):
            # Two forwards, every MoE layer fetched once each, idle rank included.
            assert run["calls"] == 2 * layers
            assert run["sent"] == 2 * layers * fetch
            before, after, staging = run["report"]
            assert before - after == layers * (world - 1) * block * expert_bytes
            assert staging == 2 * fetch
            assert run["shapes"] == {(block, moe.expert_intermediate_size, moe.latent_size)}
            marks = {name.rsplit(".", 1)[-1] for name, _ in run["shards"]}
            assert marks == {"w1", "w2", "w3"} and len(run["shards"]) == 3 * layers
            assert {m for _, m in run["shards"]} == {(0, rank * block, (rank + 1) * block)}
    if idle:
        assert results[-1]["tokens"] == [0, 0]


class _Work:
    def __init__(self, events, k):
        self.events, self.k = events, k

    def wait(self):
        self.events.append(("wait", self.k))


def test_fetch_schedule_runs_one_layer_ahead_in_two_buffers(monkeypatch):
    """Single process, the transport faked: the order of issues, waits and computes."""
    import tokenspeed.parallel.dwdp as dwdp
    from tokenspeed.parallel.groups import Group

    events = []

    def fake_fetch(local, staging, group, handle, async_op):
        k = len([e for e in events if e[0] == "issue"])
        events.append(("issue", k, "async" if async_op else "sync"))
        return [_Work(events, k)] if async_op else []

    monkeypatch.setattr(dwdp, "fetch_remote_experts", fake_fetch)
    model = _model()
    layers = [m.experts for m in model.modules() if hasattr(m, "experts")]
    group = Group(None, (0, 1), 0)
    for prefetch in (True, False):
        events.clear()
        fetcher = dwdp.DwdpFetcher(layers[:4], group, None, None, prefetch)
        assert fetcher.staging_bytes == 2 * fetcher.layer_fetch_bytes > 0
        fetcher.begin()
        for k in range(3):  # layer 3 does not run: finish() fetches it anyway
            buffer = fetcher.weights(k)
            assert buffer is fetcher.staging[k % 2]
            events.append(("compute", k))
            fetcher.done(k)
        fetcher.finish()
        if prefetch:
            assert events == [
                ("issue", 0, "async"),
                ("issue", 1, "async"),
                ("wait", 0),
                ("compute", 0),
                ("issue", 2, "async"),  # into buffer 0, which layer 0 no longer reads
                ("wait", 1),
                ("compute", 1),
                ("issue", 3, "async"),
                ("wait", 2),
                ("compute", 2),
                ("wait", 3),
            ]
        else:
            assert events == [
                ("issue", 0, "sync"),
                ("compute", 0),
                ("issue", 1, "sync"),
                ("compute", 1),
                ("issue", 2, "sync"),
                ("compute", 2),
                ("issue", 3, "sync"),
            ]
