"""Paged MLA prefill / extend kernel vs `mla_prefill` (the torch reference over packed rows).

CPU: tiny shapes under TRITON_INTERPRET=1 in one subprocess (see test_mla_decode.py for why),
fp32 and fp16. GPU (marked `gpu`): K3 shapes in bf16 and FP8 with long cached prefixes cut into
several key chunks. Tolerances are relative to the largest reference output; bf16 rounds the
expanded keys and values and the probabilities once each.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from tokenspeed.model.ops.mla.decode import dequantize_pages, quantize_fp8_pages
from tokenspeed.model.ops.mla.prefill import MlaPrefillTuning, _segments, mla_prefill_paged
from tokenspeed.model.ops.mla.reference import mla_prefill

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def make_inputs(
    lens,
    n_queries,
    *,
    heads=2,
    rank=32,
    rope=16,
    nope=16,
    v_dim=32,
    page_size=8,
    dtype=torch.float32,
    device="cpu",
    seed=0,
):
    """Packed latent rows scattered into randomly placed pages; queries are each request's last
    n rows. The sink page 0 holds huge values so a read of it would show."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    per_req = [-(-length // page_size) for length in lens]
    num_pages = 1 + sum(per_req) + 2
    latent = torch.randn(sum(lens), rank + rope, generator=g)
    pages = torch.randn(num_pages, page_size, rank + rope, generator=g)
    pages[0] = 1e4
    table = torch.zeros(batch, max(per_req) + 1, dtype=torch.int32)
    order = torch.randperm(num_pages - 1, generator=g) + 1
    used = row = 0
    for b, (length, count) in enumerate(zip(lens, per_req, strict=True)):
        table[b, :count] = order[used : used + count].to(torch.int32)
        used += count
        pos = torch.arange(length)
        pages[table[b, pos // page_size].long(), pos % page_size] = latent[row : row + length]
        row += length
    q = torch.randn(sum(n_queries), heads, nope + rope, generator=g)
    weight = torch.randn(heads * (nope + v_dim), rank, generator=g) / rank**0.5
    cu_q = torch.tensor([0, *torch.tensor(n_queries).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return {
        "q": q.to(device=device, dtype=dtype),
        "pages": pages.to(device=device, dtype=dtype),
        "latent": latent,
        "weight": weight.to(device=device, dtype=dtype),
        "page_table": table.to(device),
        "cu_q": cu_q.to(device),
        "cu_k": cu_k,
        "lens": torch.tensor(lens).to(device),
        "v_dim": v_dim,
        "scale": (nope + rope) ** -0.5,
    }


def reference(inp, latent=None):
    latent = inp["latent"] if latent is None else latent
    dev = inp["q"].device
    return mla_prefill(
        inp["q"].float(),
        latent.to(dev).float(),
        inp["weight"].float(),
        inp["cu_q"],
        inp["cu_k"].to(dev),
        inp["v_dim"],
        inp["scale"],
    )


def run(inp, **kw):
    return mla_prefill_paged(
        inp["q"],
        inp["pages"],
        inp["page_table"],
        inp["cu_q"],
        inp["lens"],
        inp["weight"],
        inp["v_dim"],
        inp["scale"],
        **kw,
    )


def rel_err(out, ref):
    return float((out.float() - ref).abs().max() / ref.abs().max())


def _case(lens, n_queries, dtype=torch.float32, **kw):
    inp = make_inputs(lens, n_queries, dtype=dtype)
    out = run(inp, **kw)
    ref = reference(inp, inp["latent"].to(dtype))  # the rows the pages hold
    return {"err": rel_err(out, ref), "tol": TOL[dtype], "finite": bool(out.isfinite().all())}


def _case_fp8():
    lens, n_queries = [21, 9], [6, 9]
    inp = make_inputs(lens, n_queries)
    inp["pages"][0] = 0.0
    pages, scales = quantize_fp8_pages(inp["pages"])
    deq = dequantize_pages(pages, scales)
    # The reference reads the same dequantized rows, packed.
    latent = torch.cat(
        [
            deq[inp["page_table"][b, torch.arange(n) // 8].long(), torch.arange(n) % 8]
            for b, n in enumerate(lens)
        ]
    )
    out = run(dict(inp, pages=pages), page_scales=scales, max_chunk_rows=8)
    return {
        "err": rel_err(out, reference(inp, latent)),
        "tol": TOL[torch.float32],
        "finite": bool(out.isfinite().all()),
    }


INTERP_CASES = {
    "extend_varlen_one_launch": lambda: _case([5, 37, 20, 9], [5, 3, 17, 1]),
    # Chunks of 8 / 13 rows: several launches, each merging into the running output.
    "extend_varlen_chunks_8": lambda: _case([5, 37, 20, 9], [5, 3, 17, 1], max_chunk_rows=8),
    "extend_varlen_chunks_13": lambda: _case([5, 37, 20, 9], [2, 30, 17, 4], max_chunk_rows=13),
    "full_prefill": lambda: _case([24, 11], [24, 11]),
    "request_without_queries": lambda: _case([12, 30], [0, 5], max_chunk_rows=16),
    "fp16_chunks": lambda: _case([40, 19], [33, 2], dtype=torch.float16, max_chunk_rows=16),
    "fp8_per_page": _case_fp8,
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
    assert res["finite"]


def test_segments_bound_rows_and_keep_chunks_of_a_request_apart():
    lens, n_queries = [5, 37, 20, 9, 3], [5, 3, 0, 1, 3]
    groups = _segments(lens, n_queries, 13)
    for group in groups:
        assert sum(k for _, _, k in group) <= 13
        assert len({b for b, _, _ in group}) == len(group)
    # Every key of every request with queries is covered once, in order; none of request 2.
    for b, length in enumerate(lens):
        chunks = [(k0, k) for g in groups for r, k0, k in g if r == b]
        if n_queries[b] == 0:
            assert chunks == []
        else:
            assert [k0 for k0, _ in chunks] == list(range(0, length, 13))
            assert sum(k for _, k in chunks) == length


def test_rejects_more_queries_than_rows():
    inp = make_inputs([4], [4])
    inp["cu_q"] = torch.tensor([0, 5])
    inp["q"] = torch.randn(5, 2, 32)
    with pytest.raises(ValueError, match="more queries than cached rows"):
        run(inp)


# ----------------------------------------------------------------------------- tuning knobs


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_m", 8),
        ("block_m", 96),
        ("block_n", 0),
        ("num_warps", 3),
        ("num_warps", 64),
        ("num_stages", 0),
        ("num_stages", 2.0),
    ],
    ids=str,
)
def test_tuning_rejects_bad_knobs_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        MlaPrefillTuning(**{field: value})


def test_tuning_defaults_by_shape():
    """GPU: 64 x 64 tiles, 4 warps, 2 stages; 128 x 64, 8 warps, 3 stages past 64 new tokens
    of a request; the interpreter: 16 x 16, 4 warps, 1 stage. Given knobs win."""
    assert MlaPrefillTuning() == MlaPrefillTuning(
        block_m=None, block_n=None, num_warps=None, num_stages=None
    )
    assert len(attrs.fields(MlaPrefillTuning)) == 4  # a new knob needs its default pinned here
    tiles = lambda t: (t.block_m, t.block_n, t.num_warps, t.num_stages)  # noqa: E731
    assert tiles(MlaPrefillTuning().resolve(64, on_gpu=True)) == (64, 64, 4, 2)
    assert tiles(MlaPrefillTuning().resolve(65, on_gpu=True)) == (128, 64, 8, 3)
    assert tiles(MlaPrefillTuning().resolve(65, on_gpu=False)) == (16, 16, 4, 1)
    given = MlaPrefillTuning(block_m=32, num_stages=4).resolve(65, on_gpu=True)
    assert tiles(given) == (32, 64, 8, 4)


def _launch_kwargs(monkeypatch, tuning=None):
    from tokenspeed.model.ops.mla import prefill

    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, kw))

    monkeypatch.setattr(prefill, "_prefill_kernel", Spy())
    run(make_inputs([5, 37, 20, 9], [5, 3, 17, 1]), tuning=tuning)
    return seen[0]


def test_default_tuning_gives_the_expected_launch(monkeypatch):
    grid, kw = _launch_kwargs(monkeypatch)
    assert grid == (2, 2, 4)  # (17 queries in 16-row blocks, heads, segments)
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (16, 16, 4, 1)


def test_tuning_reaches_the_launch(monkeypatch):
    tuning = MlaPrefillTuning(block_m=32, block_n=64, num_warps=2, num_stages=3)
    grid, kw = _launch_kwargs(monkeypatch, tuning)
    assert grid == (1, 2, 4)
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]) == (32, 64, 2, 3)
    with pytest.raises(TypeError, match="MlaPrefillTuning"):
        run(make_inputs([4], [4]), tuning={"block_m": 16})


# ----------------------------------------------------------------------------- GPU, K3 shapes

K3 = {"heads": 96, "rank": 512, "rope": 64, "nope": 128, "v_dim": 128, "page_size": 64}


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [1 << 20, 3000])
def test_gpu_k3_bf16_extend_matches_reference(chunk):
    # An extension of 700 tokens over a 9k prefix, a full 300-token prefill, a 1-token step.
    lens, n_queries = [9000, 300, 2049], [700, 300, 1]
    inp = make_inputs(lens, n_queries, dtype=torch.bfloat16, device="cuda", **K3)
    out = run(inp, max_chunk_rows=chunk)
    # The reference reads the bf16-rounded rows the pages hold.
    ref = reference(inp, inp["latent"].bfloat16())
    err = rel_err(out, ref)
    assert err <= TOL[torch.bfloat16], f"relative error {err:.2e}"


@pytest.mark.gpu
def test_gpu_k3_fp8_per_page():
    lens, n_queries = [5000, 130], [200, 130]
    inp = make_inputs(lens, n_queries, dtype=torch.bfloat16, device="cuda", **K3)
    inp["pages"][0] = 0.0
    pages, scales = quantize_fp8_pages(inp["pages"])
    deq = dequantize_pages(pages, scales)
    p = K3["page_size"]
    latent = torch.cat(
        [
            deq[
                inp["page_table"][b, torch.arange(n, device="cuda") // p].long(),
                torch.arange(n, device="cuda") % p,
            ]
            for b, n in enumerate(lens)
        ]
    )
    out = run(dict(inp, pages=pages), page_scales=scales, max_chunk_rows=2048)
    err = rel_err(out, reference(inp, latent))
    assert err <= TOL[torch.bfloat16], f"relative error {err:.2e}"


if __name__ == "__main__":
    print(json.dumps({name: case() for name, case in INTERP_CASES.items()}))
