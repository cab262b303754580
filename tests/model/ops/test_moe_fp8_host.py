"""Per-call host work of `fused_experts` (CPU, kernels stubbed): what may be done once stays
done once.

At decode sizes an eager MoE layer is host-bound (docs/perf/moe.md: eager times at 16 tokens
are launch time), so work that depends only on the weights, the config or the device must not
be redone on every call: resolving the `MoeKernelConfig` (attrs.evolve and every field's
validator), fitting its tiles, the GPU's
properties; and Triton's host-side `cdiv` / `next_power_of_2`, which are constexpr functions
costing ~100x their arithmetic, stay off the launch path (plain copies in `_launch`). The weights
reach the kernels as given: no per-call conversion, copy or re-layout. `benchmarks/moe_host.py`
measures the resulting host time on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import triton

from tokenspeed.model.ops.moe import _launch
from tokenspeed.model.ops.moe import combine as combine_mod
from tokenspeed.model.ops.moe import experts as moe_experts
from tokenspeed.model.ops.moe import fp8 as fp8_mod
from tokenspeed.model.ops.moe.align import PairLayout
from tokenspeed.model.ops.moe.experts import ExpertWeights, MoeKernelConfig, fused_experts
from tokenspeed.model.ops.moe.fp8 import quantize_fp8_blocks

WIDTH, INTER, EXPERTS, TOP_K = 256, 128, 4, 2


class _Recorder:
    """Stands in for a kernel: records each launch's grid, arguments and keywords."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, args, kw))


@pytest.fixture
def stubbed(monkeypatch):
    """fused_experts on the CPU with every launch recorded, the layout stubbed, the caches
    emptied; Triton's constexpr cdiv / next_power_of_2 raise if the host path calls them."""

    def align(ids, ranks, counts, first, block_m, max_pairs):
        rows = torch.zeros(4 * block_m, dtype=torch.int32)
        one = torch.zeros(4, dtype=torch.int32)
        return PairLayout(ids.flatten(), rows, one, one, one, one[:1], block_m)

    def forbidden(*args, **kwargs):
        raise AssertionError("triton.cdiv / next_power_of_2 called on the host path")

    kernels = {
        "quant": _Recorder(),
        "up": _Recorder(),
        "down": _Recorder(),
        "combine": _Recorder(),
    }
    monkeypatch.setattr(moe_experts, "align_pairs", align)
    monkeypatch.setattr(fp8_mod, "_quantize_rows_kernel", kernels["quant"])
    monkeypatch.setattr(moe_experts.gg, "_gate_up_kernel", kernels["up"])
    monkeypatch.setattr(moe_experts.gg, "_down_kernel", kernels["down"])
    monkeypatch.setattr(combine_mod, "_combine_kernel", kernels["combine"])
    monkeypatch.setattr(triton, "cdiv", forbidden)
    monkeypatch.setattr(triton, "next_power_of_2", forbidden)
    moe_experts._resolve_entry.cache_clear()
    moe_experts._fit.cache_clear()
    return kernels


def _problem(fmt: str, tokens: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, WIDTH, generator=gen)
    w1 = torch.randn(EXPERTS, INTER, WIDTH, generator=gen) / WIDTH**0.5
    w3 = torch.randn(EXPERTS, INTER, WIDTH, generator=gen) / WIDTH**0.5
    w2 = torch.randn(EXPERTS, WIDTH, INTER, generator=gen) / INTER**0.5
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    if fmt == "fp8":
        (q1, s1), (q2, s2), (q3, s3) = (quantize_fp8_blocks(w) for w in (w1, w2, w3))
        experts = ExpertWeights(format="fp8", w1=q1, w2=q2, w3=q3, s1=s1, s2=s2, s3=s3)
    else:
        experts = ExpertWeights(format="dense", w1=w1, w2=w2, w3=w3)
    return x, weights, ids.to(torch.int32), experts


def _call(x, weights, ids, experts, **kw):
    counts = torch.zeros(EXPERTS, dtype=torch.int32)
    return fused_experts(
        x, weights, ids, experts, counts=counts, ranks=ids, activation="situ", **kw
    )


def _count(monkeypatch, owner, name):
    """Count the calls of owner.name (still calling it)."""
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("fmt", ["fp8", "dense"])
def test_config_resolved_and_fitted_once(stubbed, monkeypatch, fmt):
    """Five calls on the same weights: one resolve of the default config, two tile fits (gate/up
    and down); every call launches the same."""
    problem = _problem(fmt)
    resolves = _count(monkeypatch, MoeKernelConfig, "resolve")
    built = _count(monkeypatch, MoeKernelConfig, "__init__")
    for _ in range(5):
        _call(*problem)
    assert len(resolves) == 1
    # The one resolve's attrs.evolve; none per call (building one runs every validator).
    assert len(built) == 1, "a MoeKernelConfig was built on the per-call path"
    assert moe_experts._fit.cache_info().misses == 2
    for name in ("up", "down", "combine"):
        launches = stubbed[name].launches
        assert len(launches) == 5
        assert all(kw == launches[0][2] for _, _, kw in launches)
    assert len(stubbed["quant"].launches) == (5 if fmt == "fp8" else 0)


def test_fp8_weights_reach_the_kernels_as_given(stubbed):
    """No per-call conversion, copy or re-layout of the FP8 weights or their scales: the
    launches get the ExpertWeights' own tensors, on every call."""
    x, weights, ids, experts = _problem("fp8")
    for _ in range(3):
        _call(x, weights, ids, experts)
    for _, args, _ in stubbed["up"].launches:
        assert args[2] is experts.w1 and args[3] is experts.w3
        assert args[4] is experts.s1 and args[5] is experts.s3
    for _, args, _ in stubbed["down"].launches:
        assert args[2] is experts.w2 and args[3] is experts.s2


def test_cached_config_follows_the_rows_per_expert(stubbed, monkeypatch):
    """The cache is keyed by the table entry: a decode-sized hint and a prefill-sized one get
    their own tiles, and the explicit config's knobs win over the table's."""
    problem = _problem("fp8")
    small = moe_experts.default_config("fp8", 1).block_m
    large = moe_experts.default_config("fp8", 10_000 / EXPERTS).block_m
    resolves = _count(monkeypatch, MoeKernelConfig, "resolve")
    _call(*problem, pairs_hint=4)
    _call(*problem, pairs_hint=10_000)
    _call(*problem, pairs_hint=8)
    given = MoeKernelConfig(block_m=32)
    _call(*problem, pairs_hint=4, config=given)
    _call(*problem, pairs_hint=4, config=MoeKernelConfig(block_m=32))  # equal: same entry
    bms = [kw["BM"] for _, _, kw in stubbed["up"].launches]
    assert small != large
    assert bms == [small, large, small, 32, 32]
    assert len(resolves) == 3


def test_sm_count_and_capability_looked_up_once(monkeypatch):
    """num_sms and the Gluon dispatch's capability check read the device once per device."""
    calls = []

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: calls.append(index) or Props()
    )
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda index: calls.append(index) or (9, 0)
    )
    _launch._sm_count.cache_clear()
    moe_experts._device_capability.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        for _ in range(3):
            assert _launch._sm_count(0) == 132
            assert moe_experts._capability(cuda) == (9, 0)
        assert calls == [0, 0]
    finally:
        _launch._sm_count.cache_clear()
        moe_experts._device_capability.cache_clear()


def test_host_cdiv_and_next_power_of_2_match_triton():
    values = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 56, 127, 128, 129, 3072, 3584, 7168]
    values += [2**31 - 1, 2**31, 2**33 + 5]
    for n in values:
        assert _launch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 16, 64, 128, 256):
            assert _launch.cdiv(n, d) == triton.cdiv(n, d), (n, d)
