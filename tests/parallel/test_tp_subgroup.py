"""`apply_tp_subgroup`: the same logits as the single-process model for every rank's own
requests (uneven, an idle rank), the closed-form accounting, and refusals."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch
from torch import nn

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel.accounting import tp_subgroup_layer_bytes
from tokenspeed.parallel.comm import CommLog
from tokenspeed.parallel.dims import ParallelDims, ParallelError
from tokenspeed.parallel.groups import Group, ParallelGroups
from tokenspeed.parallel.shards import rank_slices
from tokenspeed.parallel.tp_subgroup import (
    ALL_TO_ALL,
    GATHER,
    SubgroupLinear,
    apply_tp_subgroup,
)

from .harness import run_ranks

# fp32: |logits - reference| <= ATOL + RTOL * |reference|. Sharding a projection with few
# outputs (b_proj: 1 column per rank at T = 4) takes another BLAS kernel than the whole one,
# rounding differently at 1e-7; nine layers and the KDA decay gate amplify that to ~2e-5 on
# logits of ~4 (o_proj and q/k/v alone match bit for bit). For scale: on a prefill the fp32
# single-device logits are themselves 2.6e-5 from an fp64 run of the same model.
ATOL, RTOL = 5e-5, 2e-5


def _excess(got: torch.Tensor, want: torch.Tensor) -> float:
    """How far got is from want beyond the relative tolerance (compare with ATOL)."""
    if not got.numel():
        return 0.0
    return float(((got - want).abs() - RTOL * want.abs()).max())


def _tiny(**changes) -> KimiForCausalLM:
    config = get_preset("tiny")
    if changes:
        config = config.evolve(**changes)
    return init_random_weights(KimiForCausalLM(config), seed=0)


def _empty_forward_works() -> bool:
    """Whether the model runs a step over no requests (an idle rank's step)."""
    try:
        model = _tiny()
        out = model(torch.zeros(0, dtype=torch.long), ForwardBatch.build([]), model.empty_state(0))
        return tuple(out.logits.shape) == (0, model.config.vocab_size)
    except Exception:
        return False


def _ids(rank: int, step: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(3, 512, (n,), generator=gen)


# Per world size and rank: prompt lengths, then per step the new tokens of every request
# (None: the rank sits the step out with an empty batch; only when the model supports it).
def _plan(world: int, rank: int, idle: bool):
    if world == 2:
        prompts = [[6, 2], [3]][rank]
        extend = [[2, 5], None if idle else [4]][rank]
    else:
        prompts = [[7, 3], [5], [2, 6, 1], [] if idle else [4]][rank]
        extend = [[3, 1], [2], [1, 4, 2], [] if idle else [2]][rank]
    decode = [1] * len(prompts)
    return [prompts, extend, decode]


def _step(model, state, lens, ids):
    if lens is None:  # idle: an empty step, the state carried over unchanged
        lens, ids = [], ids[:0]
        out = model(ids, ForwardBatch.build([]), model.empty_state(0))
        return out.logits, state
    batch = ForwardBatch.build(lens, prefix_lens=state.num_tokens)
    out = model(ids, batch, state)
    return out.logits, out.state


def _run_plan(model, ref, rank, world, idle):
    """Max |logits - reference| of each step of this rank's plan."""
    errors = []
    steps = _plan(world, rank, idle)
    state = model.empty_state(len(steps[0]))
    ref_state = ref.empty_state(len(steps[0]))
    for step, lens in enumerate(steps):
        ids = _ids(rank, step, sum(lens or []))
        got, state = _step(model, state, lens, ids)
        want, ref_state = _step(ref, ref_state, lens, ids)
        assert got.shape == want.shape, (step, got.shape, want.shape)
        errors.append(_excess(got, want))
    return errors


def _ranks_check(rank, world):
    idle = _empty_forward_works()
    groups = ParallelGroups.build(ParallelDims(world_size=world, tp=world))
    results = {"idle": idle}

    # 1. Default projections (shared gathers): every step matches the single-process model.
    model = _tiny()
    ref = copy.deepcopy(model)
    log = CommLog()
    report = apply_tp_subgroup(model, groups, log=log)
    results["bytes"] = (report.weight_bytes_before, report.weight_bytes_after)
    results["names"] = sorted(n for n, _ in model.named_parameters()) == sorted(
        n for n, _ in ref.named_parameters()
    )
    results["default"] = _run_plan(model, ref, rank, world, idle)

    # 1b. Shared gathers: one all-gather per distinct input per layer (KDA's six readers of the
    # hidden share one), nothing gathered kept after the forward, and the bytes the closed
    # forms of `accounting` give (t tokens on every member).
    log.reset()
    tokens = 6
    model(_ids(rank, 8, tokens), ForwardBatch.build([4, 2]), model.empty_state(2))
    shares = {id(m.share): m.share for m in model.modules() if getattr(m, "share", None)}
    results["shared"] = (
        dict(log.sent),
        dict(log.calls),
        tokens,
        len(shares),
        any(share.holding for share in shares.values()),
    )

    # 2. One gather per projection, the low-rank KDA gate and a plain MLA q_proj (Kimi Linear's
    # forms), the dense MLP sharded too.
    base = get_preset("tiny")
    variant = {
        "kda": attrs.evolve(base.kda, full_rank_output_gate=False),
        "mla": attrs.evolve(base.mla, q_lora_rank=None),
    }
    model = _tiny(**variant)
    ref = copy.deepcopy(model)
    projections = ("q_proj", "g_a_proj", "g_b_proj", "f_b_proj", "o_proj", "dense_mlp")
    apply_tp_subgroup(model, groups, projections=projections, share_gather=False)
    results["unshared"] = _run_plan(model, ref, rank, world, idle)
    ref = _tiny()

    # 3. Accounting: o_proj alone (64 -> 64 in every layer), t tokens on every rank.
    model = _tiny()
    log = CommLog()
    apply_tp_subgroup(model, groups, log=log, projections=("o_proj",))
    tokens = 6
    out = model(_ids(rank, 9, tokens), ForwardBatch.build([4, 2]), model.empty_state(2))
    want = ref(_ids(rank, 9, tokens), ForwardBatch.build([4, 2]), ref.empty_state(2))
    results["o_proj"] = _excess(out.logits, want.logits)
    results["o_proj_log"] = (dict(log.sent), dict(log.calls), tokens)

    # 4. One projection alone with uneven rows, one member with none.
    torch.manual_seed(0)
    linear = nn.Linear(8, 4 * world, bias=True)
    shard = SubgroupLinear(linear, groups["tp"], None)
    rows = [3, 0, 5, 1][rank]
    x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        y, want = shard(x), linear(x)
    results["linear"] = _excess(y, want)
    results["linear_shape"] = tuple(y.shape)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_logits_match_the_single_process_model(world):
    results = run_ranks(_ranks_check, world, timeout=240)
    hidden, layers = 64, 9
    for rank, r in enumerate(results):
        assert r["names"], "parameter names changed"
        assert r["bytes"][1] < r["bytes"][0]
        assert max(r["default"]) < ATOL, (rank, r["default"])
        assert max(r["unshared"]) < ATOL, (rank, r["unshared"])
        assert r["o_proj"] < ATOL
        assert r["linear"] < 1e-6 and r["linear_shape"] == ([3, 0, 5, 1][rank], 4 * world)
        # Closed form: t tokens on every member, o_proj H -> H in each of the 9 layers:
        # ((T-1) + (T-1)/T) * H * 4 bytes per local token per projection.
        sent, calls, tokens = r["o_proj_log"]
        assert calls == {GATHER: layers, ALL_TO_ALL: layers}
        per_token = (sent[GATHER] + sent[ALL_TO_ALL]) / (layers * tokens)
        assert per_token == ((world - 1) + (world - 1) / world) * hidden * 4
        # Shared gathers: per layer one gather of the attention input and one of o_proj's; per
        # MoE layer (8 of 9) one of the shared experts' input (gate / up) and one of down's.
        sent, calls, tokens, shares, holding = r["shared"]
        config = get_preset("tiny")
        moe_layers = sum(kind == "moe" for kind in config.mlp_kinds)
        assert shares == layers + moe_layers  # a SharedGather per attention and per MoE layer
        assert calls[GATHER] == 2 * layers + 2 * moe_layers
        assert not holding, "a SharedGather kept a gathered input after the forward"
        closed = sum(tp_subgroup_layer_bytes(config, i, world, 4) for i in range(layers))
        assert sent[GATHER] + sent[ALL_TO_ALL] == closed * tokens
    # Every member agrees on whether the idle member (no tokens) took part.
    assert len({r["idle"] for r in results}) == 1


def _fake_groups(size: int, index: int = 0) -> ParallelGroups:
    """Groups for transforms that only slice (no collective runs): no process group needed."""
    group = Group(None, tuple(range(size)), index)
    dims = ParallelDims(world_size=size, tp=size)
    return ParallelGroups(dims, index, torch.device("cpu"), {"tp": group})


def test_a_projection_width_not_divisible_is_refused_and_nothing_changes():
    # kv_a_proj_with_mqa: kv_lora_rank 30 + rope 16 = 46 outputs (heads and hidden divide).
    model = _tiny(mla=attrs.evolve(get_preset("tiny").mla, kv_lora_rank=30))
    with pytest.raises(ParallelError, match=r"tp_subgroup=4 .* 46 output features of .*kv_a_proj"):
        apply_tp_subgroup(model, _fake_groups(4))
    assert not any(isinstance(m, SubgroupLinear) for m in model.modules())
    apply_tp_subgroup(model, _fake_groups(2))  # 46 splits in two


def test_bad_selections_and_a_second_application_are_refused():
    model = _tiny()
    with pytest.raises(ParallelError, match="kv_b_proj"):
        apply_tp_subgroup(model, _fake_groups(2), projections=("kv_b_proj",))
    with pytest.raises(ParallelError, match="unknown layer kind"):
        apply_tp_subgroup(model, _fake_groups(2), projections=("moe.o_proj",))
    apply_tp_subgroup(model, _fake_groups(2), projections=("kda.o_proj",))
    assert isinstance(model.model.layers[0].self_attn.o_proj, SubgroupLinear)
    assert isinstance(model.model.layers[3].self_attn.o_proj, nn.Linear)  # an MLA layer
    with pytest.raises(ParallelError, match="already transformed"):
        apply_tp_subgroup(model, _fake_groups(2), projections=("o_proj",))


def test_on_the_meta_device_shards_are_marked_with_names_unchanged():
    with torch.device("meta"):
        model = KimiForCausalLM(get_preset("tiny"))
    names = [n for n, _ in model.named_parameters()]
    report = apply_tp_subgroup(model, _fake_groups(4, index=1))
    assert [n for n, _ in model.named_parameters()] == names
    slices = rank_slices(model)
    shard = slices["model.layers.0.self_attn.q_proj.weight"]
    assert (shard.dim, shard.start, shard.stop) == (0, 16, 32)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (16, 64)
    shard = slices["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"]
    assert (shard.dim, shard.start, shard.stop) == (0, 12, 24)
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in slices
    assert "model.layers.0.mlp.down_proj.weight" not in slices  # dense MLP local by default
    assert "model.layers.3.self_attn.kv_b_proj.weight" not in slices
    assert report.weight_bytes_after < report.weight_bytes_before
