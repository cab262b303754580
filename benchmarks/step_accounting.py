"""Where an engine's time goes, against the roofline: benchmarks/offline.py's per-step accounting.

A `StepProbe` runs the engine's steps itself (`run_plan(plan_step())`, as `engine.step` does),
keeping each plan's forwards for the roofline and timing every step; `phase_stats` sums the
steps per phase; `profile_run` reruns a workload under torch.profiler for the GPU's busy time;
`roofline_report` renders the report's section.

Roofline (benchmarks/roofline.py): every run's schedule is counted from the engine's own plans
(each step goes through `plan_step` / `run_plan` here: the decode forwards with their batch
sizes and contexts, the prefill chunks) and priced at the device's measured rates (a 1 GiB
device-to-device copy, a bf16 8192^3 matmul): roofline seconds = decode bytes / copy bandwidth +
prefill FLOPs / matmul rate, printed beside ours and the fraction roofline / ours, for the run
and for its prefill steps (those with a prefill chunk) and decode steps (the others). ESTIMATED:
the routed experts a decode forward selects (uniform routing of B tokens x top-k of E experts:
E * (1 - (1 - k/E)^B) distinct experts; not counted from the router) and the KDA prefill FLOPs;
the rest is counted from the config and the schedule, or measured.

Where the time goes, per phase: host time per engine step (scheduling, `run_plan` before its
first forward reaches the GPU, after the step's last GPU work: sync return, bookkeeping, the
output loop), host time inside the runner's forwards (input building + launch) and the sampler,
and the GPU span of each step (CUDA events before and after every forward and sample, placed on
the host clock: an upper bound on the GPU's busy time). With --profile, a further run of the same
workload on other prompts under torch.profiler gives the GPU's busy time itself (kernels and
copies, union over streams) per phase. The instrumentation of the timed run (two host clock
reads and two CUDA events per forward and sample) costs microseconds a step.
"""

from __future__ import annotations

import bisect
import gc
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import roofline as rf
from tokenspeed.runtime.step_plan import is_multi_step

# ---------------------------------------------------------------------- step instrumentation


@dataclass
class Call:
    """One runner forward or sampler call: host clock at entry and exit; on CUDA, events
    recorded at entry and exit (`g0`, `g1`: their GPU times on the host clock, once resolved)."""

    kind: str  # "forward" or "sample"
    t0: float
    t1: float
    e0: object = None
    e1: object = None
    g0: float | None = None
    g1: float | None = None


@dataclass
class StepRecord:
    phase: str  # "prefill" (the plan has a prefill chunk) or "decode"
    t_plan: float  # host clock: plan_step called
    t_run: float  # plan_step returned, run_plan called
    t_end: float  # run_plan returned
    calls: list[Call]
    forwards: list  # the roofline's DecodeForward / PrefillForward of the plan


def plan_forwards(plan) -> list:
    """The roofline's forwards of a scheduler plan (read before it runs: the requests' counters
    move on as it completes)."""
    out = []
    if plan.prefill is not None:
        out.append(
            rf.PrefillForward(tuple((c.start, c.end, c.is_last) for c in plan.prefill.chunks))
        )
    if plan.decode is not None:
        base = [r.num_computed for r in plan.decode.requests]
        steps = plan.decode.steps if is_multi_step(plan) else 1
        out += [rf.DecodeForward(tuple(n + j for n in base)) for j in range(steps)]
    return out


class StepProbe:
    """Runs an engine's steps as `engine.step` does (`run_plan(plan_step())`), timing them and
    keeping each plan's forwards for the roofline. Wraps the engine's `runner.forward`,
    `runner.decode` and `sampler.sample` (host clock at entry and exit; on CUDA an event at each,
    resolved to the host clock against a reference event recorded on the idle device)."""

    def __init__(self, engine):
        self.engine = engine
        self.cuda = engine.device.type == "cuda"
        self.steps: list[StepRecord] = []
        self.annotate = False  # each step in a profiler range (the --profile run)
        self._calls: list[Call] | None = None
        self._depth = 0
        self._ref = None
        self._ref_t = 0.0
        runner = engine.runner
        runner.forward = self._wrap(runner.forward, "forward")
        runner.decode = self._wrap(runner.decode, "forward")
        engine.sampler.sample = self._wrap(engine.sampler.sample, "sample")

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _wrap(self, fn, kind: str):
        def wrapped(*args, **kwargs):
            if self._calls is None or self._depth:  # outside a step, or nested (decode -> forward)
                return fn(*args, **kwargs)
            self._depth += 1
            try:
                t0 = time.perf_counter()
                e0 = self._event()
                out = fn(*args, **kwargs)
                e1 = self._event()
                t1 = time.perf_counter()
            finally:
                self._depth -= 1
            self._calls.append(Call(kind, t0, t1, e0, e1))
            return out

        return wrapped

    def start(self) -> None:
        self.steps = []
        if self.cuda:
            torch.cuda.synchronize()
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref_t = time.perf_counter()
            self._ref.record()  # on the idle device: it completes at once
            torch.cuda.synchronize()

    def step(self):
        engine = self.engine
        with torch.profiler.record_function("offline.step") if self.annotate else nullcontext():
            t_plan = time.perf_counter()
            plan = engine.plan_step()
            t_run = time.perf_counter()
            forwards = plan_forwards(plan)
            self._calls = calls = []
            try:
                outs = engine.run_plan(plan)
            finally:
                self._calls = None
            t_end = time.perf_counter()
        phase = "prefill" if plan.prefill is not None else "decode"
        self.steps.append(StepRecord(phase, t_plan, t_run, t_end, calls, forwards))
        return outs

    def finish(self) -> list[StepRecord]:
        """Resolve the events to host-clock seconds (after the run) and return the steps."""
        if self.cuda:
            torch.cuda.synchronize()
            ref = self._ref
            for record in self.steps:
                for call in record.calls:
                    call.g0 = self._ref_t + ref.elapsed_time(call.e0) / 1e3
                    call.g1 = self._ref_t + ref.elapsed_time(call.e1) / 1e3
                    call.e0 = call.e1 = None
        return self.steps


# --------------------------------------------------------------------- per-phase accounting

PHASES = ("prefill", "decode")


@dataclass
class PhaseStats:
    steps: int = 0
    forwards: int = 0  # forward calls (a prefill step may take several: checkpoint pieces)
    wall: float = 0.0  # host seconds from each step's plan to the next step's
    schedule: float = 0.0  # in plan_step
    before_gpu: float = 0.0  # run_plan called -> its first forward / sample starts on the GPU
    after_gpu: float = 0.0  # the step's last GPU work done -> the next step's plan
    span: float = 0.0  # first forward / sample starts on the GPU -> the step's last GPU work
    forward_host: float = 0.0  # host seconds inside the runner's forwards
    sample_host: float = 0.0
    samples: int = 0
    timed: bool = False  # events resolved (CUDA)
    forwards_roof: list = field(default_factory=list)


def phase_stats(steps: list[StepRecord]) -> dict[str, PhaseStats]:
    stats = {phase: PhaseStats() for phase in PHASES}
    for i, s in enumerate(steps):
        nxt = steps[i + 1].t_plan if i + 1 < len(steps) else s.t_end
        p = stats[s.phase]
        p.steps += 1
        p.wall += nxt - s.t_plan
        p.schedule += s.t_run - s.t_plan
        p.forwards_roof += s.forwards
        for call in s.calls:
            if call.kind == "forward":
                p.forwards += 1
                p.forward_host += call.t1 - call.t0
            else:
                p.samples += 1
                p.sample_host += call.t1 - call.t0
        timed = [c for c in s.calls if c.g0 is not None]
        if timed:
            p.timed = True
            gpu_start = min(c.g0 for c in timed)
            gpu_end = max(c.g1 for c in timed)
            p.span += gpu_end - gpu_start
            p.before_gpu += max(0.0, gpu_start - s.t_run)
            p.after_gpu += max(0.0, nxt - gpu_end)
    return stats


# ----------------------------------------------------------- GPU busy time (torch.profiler)


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels of two streams overlap)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def busy_in_windows(
    windows: Sequence[tuple[float, float]], intervals: Iterable[tuple[float, float]]
) -> list[float]:
    """For each of the non-overlapping `windows` [start, end), the length of the union of
    `intervals` inside it."""
    clipped: list[list[tuple[float, float]]] = [[] for _ in windows]
    order = sorted(range(len(windows)), key=lambda i: windows[i][0])
    starts = [windows[i][0] for i in order]
    for start, end in intervals:
        j = bisect.bisect_right(starts, start) - 1
        j = max(j, 0)
        while j < len(order) and windows[order[j]][0] < end:
            w_start, w_end = windows[order[j]]
            lo, hi = max(start, w_start), min(end, w_end)
            if lo < hi:
                clipped[order[j]].append((lo, hi))
            j += 1
    return [union_length(c) for c in clipped]


def profile_run(probe: StepProbe, workload: Callable[[Callable], dict]) -> dict:
    """`workload(step)` (a run of the workload whose engine steps are `step()`; it returns
    offline.py's `run_requests` dict) under torch.profiler (CPU + CUDA activities), each step in
    an "offline.step" range: the GPU's busy time (kernels, copies and sets, union over streams)
    inside each step's window (from its plan to the next step's), summed per phase. On the CPU
    (--smoke) only the host's activity is recorded: the code path runs, its busy time is 0."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if probe.cuda:
        activities.append(ProfilerActivity.CUDA)
    probe.start()
    probe.annotate = True
    try:
        with profile(activities=activities) as prof:
            got = workload(probe.step)
    finally:
        probe.annotate = False
    steps = probe.finish()
    starts, ends, work = [], [], []
    gpu_kinds = {"kernel", "gpu_memcpy", "gpu_memset"}
    for e in prof.profiler.kineto_results.events():
        on_gpu = str(e.device_type()).endswith("CUDA")
        if not on_gpu and e.name() == "offline.step":
            starts.append(e.start_ns())
            ends.append(e.end_ns())
        elif on_gpu:
            try:
                kind = e.activity_type()
            except Exception:  # older bindings: anything but an annotation on the GPU
                kind = "annotation" if e.is_user_annotation() else "kernel"
            if kind in gpu_kinds:
                work.append((e.start_ns(), e.end_ns()))
    order = sorted(range(len(starts)), key=starts.__getitem__)
    starts = [starts[i] for i in order]
    ends = [ends[i] for i in order]
    windows = [
        (starts[i], starts[i + 1] if i + 1 < len(starts) else ends[i]) for i in range(len(starts))
    ]
    busy = busy_in_windows(windows, work)
    out = {
        "seconds": got["seconds"],
        "windows": len(windows),
        "steps": len(steps),
        "cuda": probe.cuda,
    }
    if len(windows) == len(steps):
        for phase in PHASES:
            rows = [i for i, s in enumerate(steps) if s.phase == phase]
            wall = sum((windows[i][1] - windows[i][0]) / 1e9 for i in rows)
            out[phase] = (sum(busy[i] for i in rows) / 1e9, wall)
    wall = sum(w[1] - w[0] for w in windows) / 1e9
    out["total"] = (sum(busy) / 1e9, wall)
    return out


# ---------------------------------------------------------------------- measured rates


@dataclass
class Rates:
    copy_bandwidth: float  # bytes/s, read + written
    matmul_rate: float  # FLOP/s
    copy_note: str
    matmul_note: str


def measure_rates(device: torch.device, smoke: bool) -> Rates:
    """The device's copy bandwidth and matmul rate (before any model is on it)."""
    if smoke:
        return Rates(
            rf.copy_bandwidth(device, 64 << 20, iters=3),
            rf.matmul_rate(device, 256, torch.float32, iters=3),
            "64 MiB host copy, bytes read + written (smoke)",
            "fp32 256^3 on the host (smoke)",
        )
    rates = Rates(
        rf.copy_bandwidth(device),
        rf.matmul_rate(device),
        "1 GiB device-to-device copy, bytes read + written",
        "bf16 8192^3",
    )
    gc.collect()
    torch.cuda.empty_cache()
    return rates


# ---------------------------------------------------------------------- the report


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.1%}" if den > 0 else "-"


def _ms(seconds: float, count: int) -> str:
    return f"{seconds / count * 1e3:.2f}" if count else "-"


def roofline_report(
    label: str, config, run, rates: Rates, weight_bytes: int, hf_s: float | None = None
) -> list[str]:
    """The run's roofline (total and per phase) beside its time, and where the time goes.
    run: offline.py's `OurRun` (seconds, steps, cache, profiled, profile_error); hf_s:
    transformers' seconds on the same workload, when it ran."""

    def roof(forwards):
        return rf.roofline(
            config, forwards, rates.copy_bandwidth, rates.matmul_rate, run.cache, weight_bytes
        )

    everything = [f for s in run.steps for f in s.forwards]
    total = roof(everything)
    upper = rf.roofline(
        config,
        everything,
        rates.copy_bandwidth,
        rates.matmul_rate,
        run.cache,
        weight_bytes,
        all_experts=True,
    )
    stats = phase_stats(run.steps)
    prof = run.profiled or {}
    mean_batch = total.decode_rows / total.decode_forwards if total.decode_forwards else 0.0
    contexts = [
        c for s in run.steps for f in s.forwards if hasattr(f, "contexts") for c in f.contexts
    ]
    mean_context = sum(contexts) / len(contexts) if contexts else 0.0
    lines = [
        f"## roofline and where the time goes: {label}",
        "",
        f"measured: copy bandwidth {_si(rates.copy_bandwidth, 'B/s')} ({rates.copy_note}); "
        f"matmul {_si(rates.matmul_rate, 'FLOP/s')} ({rates.matmul_note})",
        f"schedule (counted from the engine's plans): {total.prefill_steps} prefill steps "
        f"({total.prefill_tokens} tokens), {total.decode_forwards} decode forwards "
        f"({total.decode_rows} rows, mean batch {mean_batch:.1f}, mean context "
        f"{mean_context:.0f} tokens)",
        "",
        "| phase | engine steps | model forwards | ours s | roofline s | roofline / ours "
        "| GPU span (events) / wall | GPU busy (profiler) / wall |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    names = {"prefill": "prefill (steps with a prefill chunk)", "decode": "decode (the others)"}
    for phase in PHASES:
        p = stats[phase]
        r = roof(p.forwards_roof)
        span = _ratio(p.span, p.wall) if p.timed else "-"
        busy = _ratio(*prof[phase]) if phase in prof else "-"
        lines.append(
            f"| {names[phase]} | {p.steps} | {p.forwards} | {p.wall:.3f} | {r.seconds:.4g} "
            f"| {_ratio(r.seconds, p.wall)} | {span} | {busy} |"
        )
    timed = any(stats[p].timed for p in PHASES)
    span = sum(stats[p].span for p in PHASES)
    wall = sum(stats[p].wall for p in PHASES)
    lines.append(
        f"| run (end to end) | {sum(stats[p].steps for p in PHASES)} "
        f"| {sum(stats[p].forwards for p in PHASES)} | {run.seconds:.3f} | {total.seconds:.4g} "
        f"| **{_ratio(total.seconds, run.seconds)}** "
        f"| {_ratio(span, wall) if timed else '-'} "
        f"| {_ratio(*prof['total']) if 'total' in prof else '-'} |"
    )
    lines += [
        "",
        "| phase | host ms per step: scheduling (plan_step) | run_plan to its first GPU work "
        "| after the step's last GPU work (sync return, bookkeeping, output loop) "
        "| GPU idle between steps: ms per step (share of wall) "
        "| host ms per forward call (input building + launch) | host ms per sampler call |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for phase in PHASES:
        p = stats[phase]
        if p.timed:
            idle = p.schedule + p.before_gpu + p.after_gpu
            before, after = _ms(p.before_gpu, p.steps), _ms(p.after_gpu, p.steps)
            idle_cell = f"{_ms(idle, p.steps)} ({_ratio(idle, p.wall)})"
        else:
            before = after = idle_cell = "-"
        lines.append(
            f"| {phase} | {_ms(p.schedule, p.steps)} | {before} | {after} | {idle_cell} "
            f"| {_ms(p.forward_host, p.forwards)} | {_ms(p.sample_host, p.samples)} |"
        )
    decode_bytes = sum(total.decode_bytes.values())
    prefill_flops = sum(total.prefill_flops.values())
    lines += [
        "",
        f"roofline = decode bytes {_si(decode_bytes, 'B')} / {_si(rates.copy_bandwidth, 'B/s')} "
        f"= {total.decode_s:.3f} s + prefill FLOPs {_si(prefill_flops, 'FLOP')} / "
        f"{_si(rates.matmul_rate, 'FLOP/s')} = {total.prefill_s:.3f} s; total "
        f"{total.seconds:.3f} s",
        f"ours {run.seconds:.3f} s end to end: {_ratio(total.seconds, run.seconds)} of the "
        f"roofline",
        f"with every routed expert read by every decode forward (the most routing can ask for, "
        f"in place of the estimate): roofline {upper.seconds:.3f} s, "
        f"{_ratio(upper.seconds, run.seconds)} of ours",
        "decode bytes by part: "
        + "; ".join(
            f"{k} {_si(v, 'B')} ({_ratio(v, decode_bytes)})" for k, v in total.decode_bytes.items()
        ),
        "prefill FLOPs by part: "
        + "; ".join(
            f"{k} {_si(v, 'FLOP')} ({_ratio(v, prefill_flops)})"
            for k, v in total.prefill_flops.items()
        ),
        f"not in the roofline: decode FLOPs at the matmul rate "
        f"{total.decode_flops / rates.matmul_rate:.3f} s; prefill weight reads at the copy "
        f"bandwidth {total.prefill_weight_bytes / rates.copy_bandwidth:.3f} s",
    ]
    if hf_s is not None:
        lines.append(
            f"transformers / roofline: {hf_s / total.seconds:.2f}x (the most tokenspeed / "
            f"transformers can reach on this workload)"
        )
    if run.profiled is not None:
        lines.append(
            f"profiled run (the same workload on other prompts, torch.profiler on): "
            f"{run.profiled['seconds']:.3f} s end to end (timed run {run.seconds:.3f} s); "
            f"GPU busy = kernels, copies and sets inside each step's window (its plan to the "
            f"next step's), union over streams"
            + ("" if run.profiled["cuda"] else " (CPU: host activity only, so 0 by construction)")
            + (
                ""
                if "prefill" in prof
                else f"; {run.profiled['windows']} step ranges for {run.profiled['steps']} "
                "steps: per-phase split not available"
            )
        )
    elif run.profile_error is not None:
        lines.append(f"profiled run failed: {run.profile_error}")
    lines += [
        "ESTIMATED: the routed experts each decode forward selects (uniform routing, "
        "E * (1 - (1 - k/E)^B) distinct of E per MoE layer for B rows x top-k; not counted from "
        "the router) and the KDA prefill FLOPs (chunked delta rule, chunk 64). COUNTED: every "
        "other byte and FLOP, from the config and the schedule. MEASURED: copy bandwidth, "
        "matmul rate, ours seconds, the schedule (steps, batch sizes, contexts), host times, "
        "GPU span (CUDA events from a step's first forward or sample call to its last GPU work, "
        "so an upper bound on the GPU's busy time; it includes the first call's input "
        "building), GPU busy (torch.profiler, --profile: a separate run).",
    ]
    return lines
