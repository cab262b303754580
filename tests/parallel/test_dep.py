"""DEP (`apply_dep`): the same logits as one process on CPU ranks, and its accounting.

Every rank builds the same seeded tiny model as the single-device reference and as DEP copies
(fp32 dispatch, and bf16 in world 2 / FP8 in world 4), runs its own requests (uneven counts,
one rank idle in world 4) through a prefill, a prefill over that prefix and a decode step, and
returns the differences, the bytes it logged and the routing (hooked) for the closed forms. In
world 4 one crafted MoE layer puts every selected expert of a token on a distinct remote rank:
the equality case of the 2 B K bound, and the payload precisions' bytes and errors.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.moe import MoE, Mxfp4Experts, use_mxfp4_experts
from tokenspeed.parallel.comm import CommLog
from tokenspeed.parallel.dep import (
    DepMoE,
    apply_dep,
    gather_load,
    load_imbalance,
    report_load,
    reset_load,
)
from tokenspeed.parallel.dims import ParallelDims, ParallelError
from tokenspeed.parallel.fp8_payload import dequantize_rows, quantize_rows
from tokenspeed.parallel.groups import Group, ParallelGroups
from tokenspeed.parallel.shards import Shard, rank_slices

from .harness import run_ranks

ATOL = 2e-5
# Requests per rank (new tokens of the first prefill); rank 2 of world 4 has none at all.
REQUESTS = {2: [[6, 2, 3], [1]], 4: [[5, 3], [2], [], [7, 1, 4]]}
# A quantised dispatch (latent rows rounded to 8 significant bits in bf16, to 4 with a per-row
# scale in FP8 E4M3): the error of one MoE layer's output relative to its largest entry (seen:
# bf16 4e-4, FP8 5e-3) ...
LAYER_RTOL = {None: 1e-6, torch.bfloat16: 2e-3, torch.float8_e4m3fn: 2e-2}
# ... and, through the model, the logits against a single-process reference whose expert inputs
# are rounded the same way, relative to the largest logit. Not exact: the fp32 sums of DEP differ
# from one device's in the last bit, which now and then moves a value across a rounding
# boundary of the payload, and the random tiny model amplifies that (seen: up to 2e-3).
MODEL_RTOL = {None: ATOL, torch.bfloat16: 1e-2, torch.float8_e4m3fn: 1e-2}


def _tiny() -> KimiForCausalLM:
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)


def _round_payload(x: torch.Tensor, payload: torch.dtype | None) -> torch.Tensor:
    """What the dispatch does to a latent row: nothing, a bf16 round trip, or FP8 per row."""
    if payload is None:
        return x
    if payload == torch.float8_e4m3fn:
        return dequantize_rows(*quantize_rows(x), x.dtype)
    return x.to(payload).to(x.dtype)


def _reference(payload: torch.dtype | None) -> KimiForCausalLM:
    """The single-process model, its routed experts reading inputs rounded as `payload`."""
    model = _tiny()
    for module in model.modules():
        if isinstance(module, MoE) and payload is not None:
            module.experts.register_forward_pre_hook(
                lambda m, args: (_round_payload(args[0], payload), *args[1:])
            )
    return model


def _steps(lens: list[int]) -> list[tuple[list[int], bool]]:
    """(new tokens per request, continues the previous state) for the three steps."""
    return [(lens, False), ([1 + n % 3 for n in lens], True), ([1] * len(lens), True)]


def _idle_step(model: KimiForCausalLM) -> None:
    """An idle rank's step: the model's forward over no requests (every MoE layer still joins
    its count exchange and both all-to-alls, on 0 rows)."""
    empty = torch.zeros(0, dtype=torch.int64)
    out = model(empty, ForwardBatch.build(seq_lens=[]), model.empty_state(0))
    assert out.logits.shape == (0, model.config.vocab_size)


def _routing_rows(model: KimiForCausalLM, ep: Group) -> list[torch.Tensor]:
    """Hooks recording, per DEP layer call, the rows the closed form says this rank sends each
    member of the ep group: the tokens with at least one expert there ([R] int64; the entry
    of this rank is the rows it keeps)."""
    rows: list[torch.Tensor] = []

    def hook(module, inputs, output):
        _, ids = output
        dest = ids // module_per[id(module)]
        needs = torch.zeros(ids.shape[0], ep.size, dtype=torch.bool).scatter_(1, dest, True)
        rows.append(needs.sum(0))

    module_per = {}
    for module in model.modules():
        if isinstance(module, DepMoE):
            module_per[id(module.gate)] = module.dep_local_experts
            module.gate.register_forward_hook(hook)
    return rows


def _run(rank, world, payloads):
    torch.manual_seed(0)
    groups = ParallelGroups.build(ParallelDims(world_size=world, ep=world))
    ep = groups["ep"]
    lens = REQUESTS[world][rank]
    references = {p: _reference(p) for p in payloads}
    reference = references[None]
    moe_layers = sum(isinstance(m, MoE) for m in reference.modules())
    top_k = reference.config.moe.top_k
    width = reference.config.moe.latent_size
    models, logs = {}, {}
    for payload in payloads:
        logs[payload] = CommLog()
        models[payload] = _tiny()
        report = apply_dep(models[payload], groups, log=logs[payload], payload_dtype=payload)
        assert report.weight_bytes_after < report.weight_bytes_before
    closed_form = _routing_rows(models[None], ep)
    gen = torch.Generator().manual_seed(100 + rank)
    states = {}
    result = {"diff": [], "steps": []}
    tokens_seen = 0
    for step, (seq_lens, extend) in enumerate(_steps(lens or [1])):
        logged = dict(logs[None].sent)
        calls_before = len(closed_form)
        if not lens:
            for payload in payloads:
                _idle_step(models[payload])
            tokens = 0
        else:
            ids = torch.randint(3, reference.config.vocab_size, (sum(seq_lens),), generator=gen)
            tokens = len(ids)
            outs = {}
            runs = [*((("ref", p), m) for p, m in references.items()), *models.items()]
            for key, model in runs:
                state = states[key] if extend else model.empty_state(len(seq_lens))
                prefix = state.num_tokens if extend else None
                out = model(ids, ForwardBatch.build(seq_lens, prefix_lens=prefix), state)
                states[key], outs[key] = out.state, out.logits
            scale = outs["ref", None].abs().max().item()
            for payload in payloads:
                diff = (outs[payload] - outs["ref", payload]).abs().max().item()
                result["diff"].append((step, payload, diff if payload is None else diff / scale))
        tokens_seen += tokens
        sent = {k: v - logged.get(k, 0) for k, v in logs[None].sent.items()}  # fp32 payload
        calls = closed_form[calls_before:]
        assert len(calls) == moe_layers, (step, len(calls))
        result["steps"].append(
            {
                "tokens": tokens,
                "dispatch_rows": sent.get("dep.dispatch", 0) / (width * 4),
                "meta_bytes": sent.get("dep.dispatch.meta", 0),
                "combine_rows": sent.get("dep.combine", 0) / (width * 4),
                "to_each": torch.stack(calls).sum(0),  # closed form, per destination
            }
        )
    load = report_load(models[None])
    result["local_load"] = sum(int(v.sum()) for v in load.values())
    result["gathered"] = gather_load(models[None], groups)
    result["imbalance"] = load_imbalance(models[None], groups)
    result["tokens"] = tokens_seen
    result["moe_layers"] = moe_layers
    result["top_k"] = top_k
    result["local_experts"] = {
        n: tuple(m.experts.w1.shape) for n, m in models[None].named_modules() if isinstance(m, MoE)
    }
    reset_load(models[None])
    result["after_reset"] = sum(int(v.sum()) for v in report_load(models[None]).values())
    result["worst_case"] = _worst_case(rank, world) if world == 4 else None
    result["mxfp4"] = _mxfp4_layer(rank, world) if world == 2 else 0.0
    return result


def _mxfp4_layer(rank, world) -> float:
    """One MoE layer with MXFP4 experts (sliced buffers): DEP against the whole layer."""
    config = get_preset("tiny")
    torch.manual_seed(5)
    moe = MoE(config.hidden_size, config.moe, config.activation, 1e-6)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    moe.experts = Mxfp4Experts.quantize(moe.experts)
    x = torch.randn(4 + 3 * rank, config.hidden_size, generator=torch.Generator().manual_seed(rank))
    want = moe(x)
    apply_dep(moe, ParallelGroups.build(ParallelDims(world_size=world, ep=world)))
    assert moe.experts.w1_packed.shape[0] == config.moe.num_experts // world
    return (moe(x) - want).abs().max().item()


def _worst_case(rank, world):
    """One MoE layer (top_k 3, 16 experts over 4 ranks) whose router sends each token of rank r
    to one expert on each of the 3 other ranks: every selected expert remote, on distinct
    ranks, so this rank's tokens cost exactly B K rows out and B K back. Also the payload
    precisions: the layer's error against fp32 and the dispatch bytes (FP8 a quarter)."""
    config = get_preset("tiny")
    moe_config = attrs.evolve(config.moe, top_k=3)
    per = moe_config.num_experts // world
    tokens = [3, 1, 0, 5][rank]
    out = {"tokens": tokens, "top_k": moe_config.top_k, "width": moe_config.latent_size}
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(tokens, config.hidden_size, generator=gen) * 0.1
    x[:, rank] += 10.0  # the owner's marker feature
    groups = ParallelGroups.build(ParallelDims(world_size=world, ep=world))
    out["rel"], out["sent"] = {}, {}
    for payload in (None, torch.bfloat16, torch.float8_e4m3fn):
        torch.manual_seed(3)  # the same weights on every rank
        moe = MoE(config.hidden_size, moe_config, config.activation, 1e-6)
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn(p.shape) * 0.2)
            moe.gate.weight.zero_()
            moe.gate.e_score_correction_bias.zero_()
            for owner in range(world):
                for j in range(1, moe_config.top_k + 1):
                    expert = (owner + j) % world * per + (owner + j) % per
                    moe.gate.weight[expert, owner] = 1.0
        want = moe(x)
        _, ids = moe.gate(x)
        log = CommLog()
        apply_dep(moe, groups, log=log, payload_dtype=payload)
        got = moe(x)
        rel = (got - want).abs().max() / want.abs().max() if tokens else torch.tensor(0.0)
        out["rel"][payload], out["sent"][payload] = rel.item(), dict(log.sent)
        out["remote_distinct"] = bool(
            ((ids // per) != rank).all()
            and all(len(set(row.tolist())) == moe_config.top_k for row in ids // per)
        )
    return out


def _check(world, results, payloads):
    ranks_load = [r["local_load"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    top_k, layers = results[0]["top_k"], results[0]["moe_layers"]
    # Every (token, expert) pair is computed exactly once, somewhere.
    assert sum(ranks_load) == tokens * top_k * layers
    for rank, r in enumerate(results):
        for name, shape in r["local_experts"].items():
            assert shape[0] == 16 // world, (name, shape)
        assert r["after_reset"] == 0
        assert r["mxfp4"] <= ATOL
        # The gathered load is the same on every rank and its sums are the local loads.
        for name, load in r["gathered"].items():
            assert torch.equal(load, results[0]["gathered"][name])
            assert load.shape == (16,)
        per_rank = [
            sum(int(load.view(world, -1)[i].sum()) for load in r["gathered"].values())
            for i in range(world)
        ]
        assert per_rank == ranks_load
        assert all(v >= 1.0 for v in r["imbalance"].values())
        for step, payload, diff in r["diff"]:
            assert diff <= MODEL_RTOL[payload], (rank, step, payload, diff)
    # Accounting per step against the closed form (per destination rows from the routing):
    # rank r dispatches, to each other member d, one row per token with an expert on d, and
    # combines back the rows it received; so the rows of r's own B tokens, out and back, are
    # 2 * sum_d rows[r -> d] <= 2 B K per MoE layer.
    for i in range(len(results[0]["steps"])):
        rows = torch.stack([r["steps"][i]["to_each"] for r in results])  # [from, to]
        remote = rows * (1 - torch.eye(world, dtype=rows.dtype))
        for rank, r in enumerate(results):
            step = r["steps"][i]
            assert step["dispatch_rows"] == int(remote[rank].sum()), (rank, i)
            assert step["combine_rows"] == int(remote[:, rank].sum()), (rank, i)
            assert step["meta_bytes"] == step["dispatch_rows"] * top_k * 8
            own_rows = 2 * step["dispatch_rows"]  # out, and the same rows back
            assert own_rows <= 2 * step["tokens"] * top_k * layers
        assert sum(r["steps"][i]["dispatch_rows"] for r in results) == sum(
            r["steps"][i]["combine_rows"] for r in results
        )
    worst = [r["worst_case"] for r in results if r["worst_case"] is not None]
    total = sum(w["tokens"] for w in worst)
    for w in worst:
        b, k, width = w["tokens"], w["top_k"], w["width"]
        if b:
            assert w["remote_distinct"]
        for payload, rel in w["rel"].items():
            assert rel <= LAYER_RTOL[payload], (payload, rel)
        sent32, sent16, sent8 = (w["sent"][p] for p in (None, torch.bfloat16, torch.float8_e4m3fn))
        # Every expert remote and on distinct ranks: B K rows out and B K back, 2 B K.
        assert sent32.get("dep.dispatch", 0) == b * k * width * 4, w
        # What this rank combines is what it received: one row per token of every other rank
        # (always in the activations' dtype, fp32 here, whatever the dispatch precision).
        for sent in (sent32, sent16, sent8):
            assert sent.get("dep.combine", 0) == (total - b) * width * 4, w
        assert sent16.get("dep.dispatch", 0) * 2 == sent32.get("dep.dispatch", 0)
        assert sent8.get("dep.dispatch", 0) * 4 == sent32.get("dep.dispatch", 0)
        meta = sent32.get("dep.dispatch.meta", 0)
        assert meta == b * k * k * 8  # K fp32 weights and K int32 ids a row
        assert sent16.get("dep.dispatch.meta", 0) == meta
        assert sent8.get("dep.dispatch.meta", 0) == meta + 4 * b * k  # one fp32 scale a row


@pytest.mark.parametrize("world", [2, 4])
def test_dep_matches_one_process(world):
    payloads = [None, torch.float8_e4m3fn] if world == 4 else [None, torch.bfloat16]
    results = run_ranks(_run, world, payloads, timeout=240)
    _check(world, results, payloads)


# -- without processes ---------------------------------------------------------------------------


def _fake_groups(world: int, rank: int) -> ParallelGroups:
    """Groups of a layout without process groups: enough for `apply_dep`, which only slices."""
    dims = ParallelDims(world_size=world, ep=world)
    group = {k: Group(None, (rank,), rank) for k in ("tp", "tep", "dcp", "dwdp")}
    group["ep"] = Group(None, tuple(range(world)), rank)
    return ParallelGroups(dims, rank, torch.device("cpu"), group)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_apply_dep_slices_on_meta_and_keeps_names(mxfp4):
    with torch.device("meta"):
        model = KimiForCausalLM(get_preset("tiny"))
        if mxfp4:
            use_mxfp4_experts(model)
    names = set(model.state_dict())
    report = apply_dep(model, _fake_groups(4, 1))
    assert set(model.state_dict()) == names
    assert report.strategy == "dep" and report.saved_bytes > 0
    slices = rank_slices(model)
    tensors = ("w1_packed", "w1_scale", "w2_packed") if mxfp4 else ("w1", "w2", "w3")
    for name in tensors:
        assert slices[f"model.layers.1.mlp.experts.{name}"] == Shard(0, 4, 8)
        assert model.state_dict()[f"model.layers.1.mlp.experts.{name}"].shape[0] == 4
    assert all(isinstance(m, DepMoE) for m in model.modules() if isinstance(m, MoE))


def test_apply_dep_refuses():
    model = _tiny()
    with pytest.raises(ParallelError, match="payload_dtype"):
        apply_dep(model, _fake_groups(2, 0), payload_dtype=torch.float16)
    with pytest.raises(ParallelError, match="does not divide"):
        apply_dep(model, _fake_groups(3, 0))
    apply_dep(model, _fake_groups(2, 0))
    with pytest.raises(ParallelError, match="already expert parallel"):
        apply_dep(model, _fake_groups(2, 0))


def test_single_rank_dep_is_the_model():
    """ep of one rank: nothing to split, the model is left as it is (its fused kernels too)."""
    reference, model = _tiny(), _tiny()
    report = apply_dep(model, _fake_groups(1, 0))
    assert report.weight_bytes_before == report.weight_bytes_after
    assert not any(isinstance(m, DepMoE) for m in model.modules()) and not rank_slices(model)
    ids = torch.randint(3, 512, (9,), generator=torch.Generator().manual_seed(1))
    batch = ForwardBatch.build([4, 5])
    want = reference(ids, batch, reference.empty_state(2)).logits
    got = model(ids, batch, model.empty_state(2)).logits
    assert torch.equal(got, want)
    assert report_load(model) == {}


def test_fp8_rows_round_trip():
    x = torch.randn(5, 32) * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [500.0]])
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    back = dequantize_rows(codes, scale, torch.float32)
    assert torch.equal(back[3], torch.zeros(32))
    rel = (back - x).abs().amax(1) / x.abs().amax(1).clamp_min(1e-30)
    assert (rel <= 1 / 16).all()
    empty, s = quantize_rows(torch.zeros(0, 32))
    assert empty.shape == (0, 32) and s.shape == (0, 1)
