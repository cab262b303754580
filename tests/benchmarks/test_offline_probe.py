"""benchmarks/step_accounting.py (offline.py's step accounting) without a model: the roofline's
forwards read off scheduler plans, the per-phase host / GPU times of recorded steps and the
busy-time interval helpers (CPU, hand-made inputs)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from tokenspeed.sched import DecodeBatch, PrefillBatch, PrefillChunk, Request, StepPlan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sa():
    name = "step_accounting"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)  # it puts benchmarks/ on sys.path: taken off again
        yield module
    finally:
        sys.path[:] = path
        sys.modules.pop(name, None)


def request(rid, computed: int) -> Request:
    """A request of a 32-token prompt with `computed` tokens in its cache (decoding past 32)."""
    output = max(0, computed - 31)
    return Request(rid, 32, max_new_tokens=64, num_computed=computed, num_output=output)


def test_plan_forwards(sa):
    rf = sa.rf
    mixed = StepPlan(
        prefill=PrefillBatch((PrefillChunk(request("a", 0), 0, 32, is_last=True),)),
        decode=DecodeBatch((request("b", 40),), padded_size=1, steps=4),
    )
    # With a prefill in the plan the decode rows run one step, whatever the batch's `steps`.
    assert sa.plan_forwards(mixed) == [
        rf.PrefillForward(((0, 32, True),)),
        rf.DecodeForward((40,)),
    ]
    multi = StepPlan(
        prefill=None,
        decode=DecodeBatch((request("b", 40), request("c", 50)), padded_size=2, steps=3),
    )
    assert sa.plan_forwards(multi) == [
        rf.DecodeForward((40, 50)),
        rf.DecodeForward((41, 51)),
        rf.DecodeForward((42, 52)),
    ]
    assert sa.plan_forwards(StepPlan(prefill=None, decode=None)) == []


def test_phase_stats(sa):
    Call, Step = sa.Call, sa.StepRecord
    steps = [
        # prefill step: plan 0.0-0.1, run 0.1-1.0; GPU works 0.2-0.9 (forward) and 0.9-0.95
        Step(
            "prefill",
            0.0,
            0.1,
            1.0,
            [
                Call("forward", 0.15, 0.5, g0=0.2, g1=0.9),
                Call("sample", 0.5, 0.51, g0=0.9, g1=0.95),
            ],
            [],
        ),
        # decode step from 1.2 (the output loop took 0.2 s): plan 1.2-1.25, GPU 1.3-2.0
        Step(
            "decode",
            1.2,
            1.25,
            2.1,
            [Call("forward", 1.26, 1.3, g0=1.3, g1=1.9), Call("sample", 1.3, 1.32, g0=1.9, g1=2.0)],
            [],
        ),
    ]
    stats = sa.phase_stats(steps)
    p, d = stats["prefill"], stats["decode"]
    assert (p.steps, p.forwards, p.samples, d.steps, d.forwards) == (1, 1, 1, 1, 1)
    assert p.wall == pytest.approx(1.2)  # to the next step's plan
    assert p.schedule == pytest.approx(0.1)
    assert p.before_gpu == pytest.approx(0.1)  # run_plan at 0.1, GPU from 0.2
    assert p.span == pytest.approx(0.75)
    assert p.after_gpu == pytest.approx(0.25)  # GPU done at 0.95, next plan at 1.2
    assert p.forward_host == pytest.approx(0.35)
    assert p.sample_host == pytest.approx(0.01)
    assert d.wall == pytest.approx(0.9)  # the last step ends with its run_plan
    assert d.span == pytest.approx(0.7)
    assert d.after_gpu == pytest.approx(0.1)
    assert p.timed and d.timed
    # Without events (the CPU) nothing is placed on the GPU's timeline.
    for step in steps:
        for call in step.calls:
            call.g0 = call.g1 = None
    assert not sa.phase_stats(steps)["decode"].timed


def test_union_and_windows(sa):
    assert sa.union_length([(5, 6), (0, 2), (1, 3)]) == 4
    assert sa.union_length([]) == 0
    # Two streams overlap inside the first window; one interval straddles both windows.
    busy = sa.busy_in_windows([(0, 2), (2, 6)], [(1, 3), (1.5, 2.5), (5, 7), (-1, -0.5)])
    assert busy == [pytest.approx(1.0), pytest.approx(2.0)]
