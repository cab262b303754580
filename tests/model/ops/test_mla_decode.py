"""Split-KV MLA decode kernel vs `mla_decode_paged` (the torch reference).

CPU: tiny shapes under TRITON_INTERPRET=1, in one subprocess (the variable must be set before
triton is first imported, and other test modules import triton in this process). fp32 and fp16
there: the interpreter's tl.dot on bf16 returns garbage. GPU (marked `gpu`): K3 shapes in bf16
and FP8, ragged page tables, 1-4 queries per request, CUDA-graph replay of a changed plan.

Tolerances are relative to the largest reference output: fp32 in the interpreter is the same
math in another summation order; fp16 / bf16 round the absorbed queries, the probabilities and
the merged latent once each (emulating those roundings in torch at K3 shapes gives ~3e-3).
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from tokenspeed.model.ops.mla.decode import (
    MlaDecodeTuning,
    decode_parallelism,
    dequantize_pages,
    longest_first,
    mla_decode_paged_split,
    quantize_fp8_pages,
    quantize_fp8_rows,
)
from tokenspeed.model.ops.mla.reference import mla_decode_paged
from tokenspeed.model.ops.mla.split_plan import (
    SplitPlanBuffers,
    min_split_capacity,
    plan_decode_splits,
)

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SINK_VALUE = 1e4  # padding entries point at page 0; any read of it would show


def make_inputs(
    lens,
    n,
    *,
    heads=3,
    rank=32,
    rope=16,
    nope=16,
    v_dim=16,
    page_size=8,
    pad_rows=0,
    dtype=torch.float32,
    device="cpu",
    seed=0,
):
    """Pages scattered at random over the pool (ragged page tables), unused entries and padded
    rows on the sink page 0, which holds huge values. Returns a dict of the kernel's inputs."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens) + pad_rows
    per_req = [-(-length // page_size) for length in lens]
    max_pages = max(per_req) + 2
    num_pages = 1 + sum(per_req) + 3
    pages = torch.randn(num_pages, page_size, rank + rope, generator=g)
    pages[0] = SINK_VALUE
    order = torch.randperm(num_pages - 1, generator=g) + 1
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    used = 0
    for b, count in enumerate(per_req):
        table[b, :count] = order[used : used + count].to(torch.int32)
        used += count
    q = torch.randn(batch * n, heads, nope + rope, generator=g)
    w_uk = torch.randn(heads, nope, rank, generator=g) / nope**0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=g) / rank**0.5
    gate = torch.randn(batch * n, heads * v_dim, generator=g)
    lens_t = torch.tensor([*lens, *([n] * pad_rows)], dtype=torch.int64)
    cast = {"q": q, "pages": pages, "w_uk": w_uk, "w_uv": w_uv, "gate": gate}
    out = {k: v.to(device=device, dtype=dtype) for k, v in cast.items()}
    out.update(
        page_table=table.to(device),
        context_lens=lens_t.to(device),
        scale=(nope + rope) ** -0.5,
        n=n,
        real=len(lens) * n,
    )
    return out


def reference(inp, pages=None):
    f = {k: inp[k].float() for k in ("q", "w_uk", "w_uv")}
    pages = inp["pages"].float() if pages is None else pages
    return mla_decode_paged(
        f["q"], pages, inp["page_table"], inp["context_lens"], f["w_uk"], f["w_uv"], inp["scale"]
    )


def plan(lens, batch, parallelism, granularity, device="cpu", out=None):
    cap = min_split_capacity(batch, parallelism)
    p = plan_decode_splits(
        lens,
        parallelism=parallelism,
        max_batch=batch,
        max_splits=cap,
        granularity=granularity,
        out=out,
    )
    b = p.buffers
    if out is None and device != "cpu":
        b = SplitPlanBuffers(*(t.to(device) for t in attrs.astuple(b, recurse=False)))
    return b


KNOBS = {a.name for a in attrs.fields(MlaDecodeTuning)}
ARGS = ("q", "pages", "page_table", "context_lens", "w_uk", "w_uv", "scale")


def run(inp, splits=None, **kw):
    """`mla_decode_paged_split` with its tuning knobs given loose: they go into an
    `MlaDecodeTuning`."""
    knobs = {k: kw.pop(k) for k in list(kw) if k in KNOBS}
    if knobs:
        kw["tuning"] = MlaDecodeTuning(**knobs)
    return mla_decode_paged_split(*(inp[k] for k in ARGS), splits, **kw)


def rel_err(out, ref):
    return float((out.float() - ref).abs().max() / ref.abs().max())


# ----------------------------------------------------------------------------- interpreter cases
# Each returns (error, tolerance, extra facts asserted by the test); run in the subprocess.


def _case_planner(
    n,
    heads,
    lens,
    pad_rows=2,
    gate=False,
    dtype=torch.float32,
    tuning=None,
    granularity=8,
    parallelism=8,
    page_size=8,
):
    inp = make_inputs(lens, n, heads=heads, pad_rows=pad_rows, dtype=dtype, page_size=page_size)
    batch = inp["page_table"].shape[0]
    splits = plan(lens, batch, parallelism, granularity)
    kw = {"gate": inp["gate"]} if gate else {}
    out = run(inp, splits, tuning=tuning, **kw)
    ref = reference(inp)
    if gate:
        ref = ref * torch.sigmoid(inp["gate"].float().view_as(ref))
    real = inp["real"]
    return {
        "err": rel_err(out[:real], ref[:real]),
        "tol": TOL[dtype],
        "padded_rows_zero": bool(out[real:].eq(0).all()),
        "finite": bool(out.isfinite().all()),
        "max_splits_per_row": int(splits.num_splits.max()),
    }


def _case_uniform(n, uniform_splits):
    lens = [5, 37, 64, 4]
    inp = make_inputs(lens, n, heads=4)
    out = run(inp, uniform_splits=uniform_splits)
    real = inp["real"]
    return {
        "err": rel_err(out[:real], reference(inp)[:real]),
        "tol": TOL[torch.float32],
        "finite": bool(out.isfinite().all()),
    }


def _case_fp8(n, per_row):
    lens = [9, 40, 3]
    inp = make_inputs(lens, n, heads=4, pad_rows=1)
    inp["pages"][0] = 0.0  # the sink page must quantize like any page
    pages, scales = (quantize_fp8_rows if per_row else quantize_fp8_pages)(inp["pages"])
    ref = reference(inp, dequantize_pages(pages, scales))
    inp["pages"] = pages
    out = run(inp, plan(lens, len(lens) + 1, 6, 8), page_scales=scales)
    real = inp["real"]
    return {
        "err": rel_err(out[:real], ref[:real]),
        "tol": TOL[torch.float32],
        "finite": bool(out.isfinite().all()),
    }


def _case_any_launch_order():
    # Partials are keyed by slot, not by program: any order of the slots gives the same output.
    lens = [33, 5, 70]
    inp = make_inputs(lens, 2, heads=3)
    splits = plan(lens, 3, 8, 8)
    order = torch.randperm(splits.split_len.numel(), generator=torch.Generator().manual_seed(3))
    out = run(inp, splits, split_order=order.to(torch.int32))
    sorted_lens = splits.split_len[longest_first(splits).long()]
    return {
        "err": rel_err(out, reference(inp)),
        "tol": TOL[torch.float32],
        "longest_first_sorted": bool((sorted_lens[:-1] >= sorted_lens[1:]).all()),
        # the planner's own launch order (the default) is the device-side one
        "planner_order_is_longest_first": torch.equal(splits.split_order, longest_first(splits)),
    }


def _case_replan_in_place():
    # A captured graph reads fixed buffers: rewrite them with a new plan and new lengths.
    lens_a, lens_b = [40, 3, 17], [2, 64, 9]
    inp = make_inputs([64, 64, 64], 2, heads=3)
    bufs = SplitPlanBuffers.allocate(3, min_split_capacity(3, 8))
    errs = []
    for lens in (lens_a, lens_b):
        inp["context_lens"].copy_(torch.tensor(lens))
        plan(lens, 3, 8, 8, out=bufs)
        errs.append(rel_err(run(inp, bufs), reference(inp)))
    return {"err": max(errs), "tol": TOL[torch.float32]}


INTERP_CASES = {
    "n1_mixed_lengths": lambda: _case_planner(1, 3, [5, 37, 64, 1, 100]),
    "n2_gate": lambda: _case_planner(2, 5, [5, 37, 64, 4], gate=True),
    "n3_two_head_groups": lambda: _case_planner(
        3,
        6,
        [30, 7, 12],
        tuning=MlaDecodeTuning(block_m=16, block_n=16, num_warps=4, num_stages=1),
    ),
    # Target split 16: length 18 splits as [0, 16), [16, 18), so its last split is invisible to
    # queries 0 and 1 of the four (at 14..17); length 4: each query sees another prefix.
    "n4_causal_across_splits": lambda: _case_planner(4, 3, [18, 4, 50], gate=True),
    "n1_page_32": lambda: _case_planner(
        1, 3, [70, 33], page_size=32, parallelism=2, granularity=32
    ),
    "n2_fp16": lambda: _case_planner(2, 4, [23, 61, 8], dtype=torch.float16),
    "uniform_1": lambda: _case_uniform(2, 1),
    "uniform_7_with_empty_splits": lambda: _case_uniform(1, 7),
    "fp8_per_page": lambda: _case_fp8(1, per_row=False),
    "fp8_per_row_n3": lambda: _case_fp8(3, per_row=True),
    "replan_in_place": _case_replan_in_place,
    "any_launch_order": _case_any_launch_order,
}


@pytest.fixture(scope="module")
def interpreter_results():
    # Imported here, not at the top: the interpreter child runs this file as a plain script.
    from .triton_interpreter import run_script

    return run_script(__file__, timeout=900)


@pytest.mark.parametrize("name", sorted(INTERP_CASES))
def test_interpreter_kernel_matches_reference(interpreter_results, name):
    res = interpreter_results[name]
    assert res["err"] <= res["tol"], f"{name}: relative error {res['err']:.2e}"
    assert res.get("finite", True)
    # Padded graph rows have no splits: they come out as zeros, never NaN.
    assert res.get("padded_rows_zero", True)
    assert res.get("longest_first_sorted", True)
    assert res.get("planner_order_is_longest_first", True)


def test_interpreter_cases_use_several_splits(interpreter_results):
    # Guards the cases themselves: a plan of one split per row would not test the merge.
    assert interpreter_results["n1_mixed_lengths"]["max_splits_per_row"] >= 3
    assert interpreter_results["n4_causal_across_splits"]["max_splits_per_row"] >= 4


# ----------------------------------------------------------------------------- argument checks


def test_rejects_inconsistent_arguments():
    inp = make_inputs([10, 4], 1)
    splits = plan([10, 4], 2, 4, 8)
    with pytest.raises(ValueError, match="exactly one"):
        run(inp, splits, uniform_splits=2)
    with pytest.raises(ValueError, match="exactly one"):
        run(inp)
    with pytest.raises(ValueError, match="need page_scales"):
        bad = dict(inp, pages=inp["pages"].to(torch.float8_e4m3fn))
        run(bad, splits)
    with pytest.raises(ValueError, match="wide"):
        run(dict(inp, pages=inp["pages"][..., :-1]), splits)
    with pytest.raises(ValueError, match="plan has"):
        run(inp, plan([10], 1, 4, 8))
    with pytest.raises(ValueError, match="kernel is"):
        run(inp, splits, kernel="cuda")  # refused by MlaDecodeTuning
    # The Gluon kernel runs on Hopper only (never on the CPU or under the interpreter).
    with pytest.raises(ValueError, match="Gluon kernel does not apply"):
        run(inp, splits, kernel="gluon")
    with pytest.raises(ValueError, match="Triton kernel only"):
        run(inp, splits, kernel="gluon", block_m=64)
    with pytest.raises(TypeError, match="MlaDecodeTuning"):
        run(inp, splits, tuning={"block_m": 16})
    with pytest.raises(TypeError):
        mla_decode_paged_split(*(inp[k] for k in ARGS), splits, use_pdl=False)  # via tuning only


# ----------------------------------------------------------------------------- tuning knobs


@pytest.mark.parametrize(
    "field,value",
    [
        ("kernel", "cuda"),
        ("block_m", 8),
        ("block_m", 48),
        ("block_n", 0),
        ("num_warps", 3),
        ("num_warps", 64),
        ("num_stages", 0),
        ("gluon_block_n", 48),
        ("gluon_block_n", 256),
        ("gluon_stages", 1),
        ("fp8_convert_cols", 32),
        ("fp8_convert_cols", 384),
        ("tail_block_t", 8),
        ("tail_warps", 6),
        ("use_pdl", 1),
    ],
    ids=str,
)
def test_tuning_rejects_bad_knobs_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        MlaDecodeTuning(**{field: value})


def test_tuning_defaults_are_the_measured_ones():
    """Everything by shape but the Gluon ring (2 stages) and the e4m3 conversion width (512)."""
    assert MlaDecodeTuning() == MlaDecodeTuning(
        kernel=None,
        block_m=None,
        block_n=None,
        num_warps=None,
        num_stages=None,
        gluon_block_n=None,
        gluon_stages=2,
        fp8_convert_cols=512,
        tail_block_t=None,
        tail_warps=None,
        use_pdl=None,
    )
    assert len(attrs.fields(MlaDecodeTuning)) == 11  # a new knob needs its default pinned here
    tiles = lambda t: (t.block_m, t.block_n, t.num_warps, t.num_stages)  # noqa: E731
    # GPU: K3 decode (96 rows) in 64 x 64 tiles, two programs per split; Kimi Linear (32 rows)
    # 32 x 32; 16-row groups with 4 warps. The interpreter: 16-row cache steps, one stage.
    assert tiles(MlaDecodeTuning().resolve(96, on_gpu=True)) == (64, 64, 8, 2)
    assert tiles(MlaDecodeTuning().resolve(32, on_gpu=True)) == (32, 32, 8, 2)
    assert tiles(MlaDecodeTuning().resolve(3, on_gpu=True)) == (16, 32, 4, 2)
    assert tiles(MlaDecodeTuning().resolve(96, on_gpu=False)) == (64, 16, 4, 1)
    assert MlaDecodeTuning().head_groups(96) == 2 and MlaDecodeTuning().head_groups(32) == 1
    given = MlaDecodeTuning(block_m=32, num_stages=3).resolve(96, on_gpu=True)
    assert tiles(given) == (32, 32, 8, 3) and given.head_groups(96) == 3
    # The Gluon tiles: 64 cache rows for bf16 / fp16, 32 for e4m3.
    assert MlaDecodeTuning().gluon_tile_rows(fp8=False) == 64
    assert MlaDecodeTuning().gluon_tile_rows(fp8=True) == 32
    assert MlaDecodeTuning(gluon_block_n=16).gluon_tile_rows(fp8=False) == 16
    # The merge tail: 16 / 32 / 64-token blocks by batch, 8 warps for 64 on the GPU.
    assert MlaDecodeTuning().tail_launch(128, on_gpu=True) == (16, 4)
    assert MlaDecodeTuning().tail_launch(512, on_gpu=True) == (32, 4)
    assert MlaDecodeTuning().tail_launch(513, on_gpu=True) == (64, 8)
    assert MlaDecodeTuning().tail_launch(513, on_gpu=False) == (64, 4)
    assert MlaDecodeTuning(tail_block_t=32, tail_warps=2).tail_launch(9, True) == (32, 2)
    # The planner's budget (runtime/graphs.py): 4 waves over K3's two head groups.
    assert decode_parallelism(132, 96, 1) == 4 * 132 // 2
    assert decode_parallelism(132, 96, 1, tiles=MlaDecodeTuning(block_m=32)) == 4 * 132 // 3
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        MlaDecodeTuning().block_m = 16


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid and keyword arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, kw))


def _spied_launches(monkeypatch, tuning=None, tokens_per_request=1):
    from tokenspeed.model.ops.mla import decode

    split, tail = _LaunchSpy(), _LaunchSpy()
    monkeypatch.setattr(decode, "_split_kernel", split)
    monkeypatch.setattr(decode, "_tail_kernel", tail)
    inp = make_inputs([10, 4], tokens_per_request, heads=6)
    run(inp, uniform_splits=2, tuning=tuning)
    (split_grid, split_kw), (tail_grid, tail_kw) = split.launches[0], tail.launches[0]
    return split_grid, split_kw, tail_grid, tail_kw


def test_default_tuning_gives_the_measured_launches(monkeypatch):
    """On the CPU (the interpreter's tiles): 6 heads -> one 16-row group, 16-row cache steps,
    4 warps, one stage; the tail in 16-token blocks with 4 warps; no PDL."""
    split_grid, split_kw, tail_grid, tail_kw = _spied_launches(monkeypatch)
    assert split_grid == (1, 4)  # (head groups, 2 requests x 2 uniform splits)
    assert (split_kw["BLOCK_M"], split_kw["BLOCK_N"]) == (16, 16)
    assert (split_kw["num_warps"], split_kw["num_stages"], split_kw["USE_PDL"]) == (4, 1, False)
    assert tail_grid == (1, 6) and (tail_kw["BLOCK_T"], tail_kw["num_warps"]) == (16, 4)
    assert "launch_pdl" not in split_kw and tail_kw["USE_PDL"] is False


def test_tuning_reaches_the_launches(monkeypatch):
    tuning = MlaDecodeTuning(
        block_m=16, block_n=32, num_warps=2, num_stages=3, tail_block_t=32, tail_warps=2
    )
    split_grid, split_kw, tail_grid, tail_kw = _spied_launches(monkeypatch, tuning, 3)
    assert split_grid == (2, 4)  # 18 rows per request in 16-row groups
    assert (split_kw["BLOCK_M"], split_kw["BLOCK_N"]) == (16, 32)
    assert (split_kw["num_warps"], split_kw["num_stages"]) == (2, 3)
    assert tail_grid == (1, 6) and (tail_kw["BLOCK_T"], tail_kw["num_warps"]) == (32, 2)
    # PDL as asked (the launch option itself, launch_pdl, needs a Hopper GPU to run)
    _, split_kw, _, tail_kw = _spied_launches(monkeypatch, MlaDecodeTuning(use_pdl=True))
    assert split_kw["USE_PDL"] is True and split_kw["launch_pdl"] is True
    assert tail_kw["USE_PDL"] is True and tail_kw["launch_pdl"] is True


# ----------------------------------------------------------------------------- GPU, K3 shapes

K3 = {"heads": 96, "rank": 512, "rope": 64, "nope": 128, "v_dim": 128, "page_size": 64}
# Every length >= 4: a request verifying n tokens holds at least those n rows (a shorter one
# would leave its first queries nothing to attend to, which the reference answers with NaN).
K3_LENS = [4, 5, 64, 65, 700, 4097, 30000]


def _gpu_case(n, lens=K3_LENS, pad_rows=3, parallelism=64, dtype=torch.bfloat16, seed=1):
    inp = make_inputs(lens, n, pad_rows=pad_rows, dtype=dtype, device="cuda", seed=seed, **K3)
    splits = plan(lens, len(lens) + pad_rows, parallelism, 64, device="cuda")
    return inp, splits


def _assert_close(out, ref, real, tol):
    err = rel_err(out[:real], ref[:real])
    fro = float((out[:real].float() - ref[:real]).norm() / ref[:real].norm())
    assert err <= tol and fro <= tol / 2, f"max rel {err:.2e}, frobenius rel {fro:.2e}"


@pytest.mark.gpu
# Each (n, gate) pair compiles its own kernels: four cases cover 1-4 queries and both tails.
@pytest.mark.parametrize(("n", "gate"), [(1, True), (2, False), (3, True), (4, False)])
def test_gpu_k3_bf16_matches_reference(n, gate):
    inp, splits = _gpu_case(n)
    kw = {"gate": inp["gate"]} if gate else {}
    out = run(inp, splits, **kw)
    ref = reference(inp)
    if gate:
        ref = ref * torch.sigmoid(inp["gate"].float().view_as(ref))
    _assert_close(out, ref, inp["real"], TOL[torch.bfloat16])
    assert out[inp["real"] :].eq(0).all()


@pytest.mark.gpu
@pytest.mark.parametrize(("per_row", "n"), [(False, 1), (True, 4), (True, 1)])
def test_gpu_k3_fp8_matches_dequantized_reference(per_row, n):
    inp, splits = _gpu_case(n)
    inp["pages"][0] = 0.0
    pages, scales = (quantize_fp8_rows if per_row else quantize_fp8_pages)(inp["pages"])
    ref = reference(inp, dequantize_pages(pages, scales))
    out = run(dict(inp, pages=pages), splits, page_scales=scales)
    _assert_close(out, ref, inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
# PDL is on by default on Hopper for the merge tail and the Triton split kernel (which bf16
# takes here only with kernel="triton" or Triton tile knobs, on Hopper); this covers both.
@pytest.mark.parametrize(("uniform_splits", "use_pdl"), [(1, True), (8, False), (8, True)])
def test_gpu_k3_uniform_mode_and_pdl(uniform_splits, use_pdl):
    inp, _ = _gpu_case(2, pad_rows=0)
    out = run(inp, uniform_splits=uniform_splits, use_pdl=use_pdl)
    _assert_close(out, reference(inp), inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tiles",
    [
        MlaDecodeTuning(block_m=32, block_n=32, num_warps=8, num_stages=2),
        MlaDecodeTuning(block_m=64, block_n=32, num_warps=8, num_stages=3),
        MlaDecodeTuning(block_m=64, block_n=64, num_warps=8, num_stages=2),
    ],
    ids=lambda t: f"m{t.block_m}n{t.block_n}w{t.num_warps}s{t.num_stages}",
)
def test_gpu_k3_tile_variants(tiles):
    """The alternatives benchmarks/mla_decode.py sweeps (the default runs in every other test)."""
    from triton.runtime.errors import OutOfResources

    inp, splits = _gpu_case(1, lens=[300, 5000, 64])
    try:
        out = run(inp, splits, tuning=tiles)
    except OutOfResources as exc:  # a shape that cannot launch here is no wrong answer
        pytest.skip(f"does not fit on this device: {exc}")
    _assert_close(out, reference(inp), inp["real"], TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_a_new_plan():
    """Capture once, then rewrite plan, lengths and page table in place and replay."""
    lens_a, lens_b = [5000, 64, 700, 2], [90, 12000, 3, 2500]  # each >= n = 2
    batch, n = len(lens_a), 2
    inp = make_inputs([12000] * batch, n, device="cuda", dtype=torch.bfloat16, **K3)
    bufs = SplitPlanBuffers.allocate(batch, min_split_capacity(batch, 48), device="cuda")
    inp["context_lens"].copy_(torch.tensor(lens_a))
    plan(lens_a, batch, 48, 64, out=bufs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            run(inp, bufs, gate=inp["gate"])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(inp, bufs, gate=inp["gate"])
    used = -(-12000 // K3["page_size"])
    for lens, seed in ((lens_a, 0), (lens_b, 1)):
        inp["context_lens"].copy_(torch.tensor(lens))
        plan(lens, batch, 48, 64, out=bufs)
        # Reassign the real pages among the rows (a new batch owns other pages).
        real = inp["page_table"][:, :used]
        perm = torch.randperm(real.numel(), generator=torch.Generator().manual_seed(seed))
        real.copy_(real.reshape(-1)[perm.cuda()].view_as(real))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(inp) * torch.sigmoid(inp["gate"].float().view(-1, 96, 128))
        _assert_close(static_out, ref, batch * n, TOL[torch.bfloat16])


if __name__ == "__main__":
    results = {}
    for case_name, case in INTERP_CASES.items():
        results[case_name] = case()
    print(json.dumps(results))
