"""`apply_tp` (TEP): every rank runs the same batch and returns the single-process logits; two
all-reduces per layer against the closed form; per-rank state shapes; refusals."""

from __future__ import annotations

import copy

import attrs
import pytest
import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.moe import use_mxfp4_experts
from tokenspeed.parallel.comm import CommLog
from tokenspeed.parallel.dims import ParallelDims, ParallelError
from tokenspeed.parallel.groups import Group, ParallelGroups
from tokenspeed.parallel.shards import rank_slices
from tokenspeed.parallel.tp import ATTN, MLP, TepMoE, apply_tp
from tokenspeed.parallel.tp_subgroup import apply_tp_subgroup

from .harness import run_ranks

# fp32: |logits - reference| <= ATOL + RTOL * |reference| (partial sums over heads and expert
# slices add in another order than the single-device GEMMs). For scale: on the prefill step the
# fp32 single-device logits (~4) are themselves 2.6e-5 from an fp64 run of the same model.
ATOL, RTOL = 5e-5, 2e-5
STEPS = ([5, 3, 1], [2, 4, 3], [1, 1, 1])  # prefill, prefill with a prefix, decode


def _config(variant: str):
    base = get_preset("tiny")
    if variant == "k3":  # latent MoE with its norm, full-rank KDA gate, MLA q LoRA
        return base
    # Kimi Linear's forms: experts at the hidden width, low-rank KDA gate, plain MLA q_proj.
    return base.evolve(
        moe=attrs.evolve(base.moe, latent_size=None, latent_norm=False),
        kda=attrs.evolve(base.kda, full_rank_output_gate=False),
        mla=attrs.evolve(base.mla, q_lora_rank=None),
    )


def _tiny(variant: str = "k3") -> KimiForCausalLM:
    return init_random_weights(KimiForCausalLM(_config(variant)), seed=0)


def _excess(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs() - RTOL * want.abs()).max())


def _ranks_check(rank, world):
    groups = ParallelGroups.build(ParallelDims(world_size=world, tep=world))
    results = {}
    for variant in ("k3", "plain"):
        model = _tiny(variant)
        ref = copy.deepcopy(model)
        names = [n for n, _ in model.named_parameters()]
        log = CommLog()
        report = apply_tp(model, groups, log=log)
        heads = model.config.kda.num_heads
        out = {
            "names": [n for n, _ in model.named_parameters()] == names,
            "saved": report.saved_bytes > 0,
            "heads": (heads, model.config.mla.num_heads),
            "errors": [],
            "logs": [],
        }
        state, ref_state = model.empty_state(3), ref.empty_state(3)
        for step, lens in enumerate(STEPS):
            ids = torch.randint(3, 512, (sum(lens),), generator=torch.Generator().manual_seed(step))
            batch = ForwardBatch.build(lens, prefix_lens=state.num_tokens)
            log.reset()
            got = model(ids, batch, state)
            out["logs"].append((dict(log.sent), dict(log.calls), sum(lens)))
            want = ref(ids, batch, ref_state)
            out["errors"].append(_excess(got.logits, want.logits))
            state, ref_state = got.state, want.state
        # The rank's KDA state is its heads' slice of the single-device state; MLA rows whole.
        layer = model.config.kda_layers[0]
        first = rank * heads
        recurrent = state.kda[layer].recurrent
        out["recurrent_shape"] = tuple(recurrent.shape)
        expected = ref_state.kda[layer].recurrent[:, first : first + heads]
        out["recurrent"] = float((recurrent - expected).abs().max())
        layer = model.config.mla_layers[0]
        rows = zip(state.mla[layer], ref_state.mla[layer], strict=True)
        out["latents"] = max(float((a - b).abs().max()) for a, b in rows)
        results[variant] = out
    return results


def _all_reduce_bytes(world: int, rows: int, width: int) -> int:
    """What CommLog records for a ring all-reduce of [rows, width] fp32."""
    return 2 * (world - 1) * rows * width * 4 // world


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_returns_the_single_process_logits(world):
    results = run_ranks(_ranks_check, world, timeout=240)
    hidden, latent, layers, moe_layers = 64, 32, 9, 8
    for rank, by_variant in enumerate(results):
        for variant, r in by_variant.items():
            where = (rank, variant)
            assert r["names"] and r["saved"], where
            assert r["heads"] == (4 // world, 4 // world), where
            assert max(r["errors"]) < ATOL, (where, r["errors"])
            assert r["recurrent_shape"] == (3, 4 // world, 16, 16), where
            assert r["recurrent"] < 1e-5 and r["latents"] < 1e-5, where
            for sent, calls, tokens in r["logs"]:
                # Two all-reduces of the whole batch per layer: attention and MLP / MoE.
                assert calls == {ATTN: layers, MLP: layers}, where
                assert sent[ATTN] == layers * _all_reduce_bytes(world, tokens, hidden)
                if variant == "plain":  # both [N, hidden]: the closed form exactly
                    assert sent[MLP] == layers * _all_reduce_bytes(world, tokens, hidden)
                else:  # latent MoE: [N, latent | hidden] (routed latent and shared partials)
                    dense = _all_reduce_bytes(world, tokens, hidden)
                    moe = _all_reduce_bytes(world, tokens, latent + hidden)
                    assert sent[MLP] == dense + moe_layers * moe, where


def _fake_groups(size: int, index: int = 0) -> ParallelGroups:
    """Groups for transforms that only slice (no collective runs): no process group needed."""
    group = Group(None, tuple(range(size)), index)
    solo = Group(None, (index,), index)
    groups = {"tp": group, "tep": group, "ep": solo, "dcp": solo, "dwdp": solo}
    return ParallelGroups(
        ParallelDims(world_size=size, tep=size), index, torch.device("cpu"), groups
    )


def test_heads_or_experts_not_divisible_and_other_transforms_are_refused():
    model = _tiny()
    with pytest.raises(ParallelError, match=r"tep=3 does not divide the heads"):
        apply_tp(model, _fake_groups(3))
    assert not any(isinstance(m, TepMoE) for m in model.modules())  # nothing changed
    with pytest.raises(ParallelError, match="dense experts only"):
        apply_tp(use_mxfp4_experts(_tiny()), _fake_groups(2))
    sharded = _tiny()
    apply_tp_subgroup(sharded, _fake_groups(2))
    with pytest.raises(ParallelError, match="cannot follow apply_tp_subgroup"):
        apply_tp(sharded, _fake_groups(2))
    apply_tp(model, _fake_groups(2))
    with pytest.raises(ParallelError, match="already applied"):
        apply_tp(model, _fake_groups(2))


def test_on_the_meta_device_configs_describe_the_local_heads():
    with torch.device("meta"):
        model = KimiForCausalLM(get_preset("tiny"))
    names = [n for n, _ in model.named_parameters()]
    apply_tp(model, _fake_groups(4, index=3))
    assert [n for n, _ in model.named_parameters()] == names
    config = model.config
    assert model.model.config is config
    assert (config.kda.num_heads, config.mla.num_heads) == (1, 1)
    assert config.moe.expert_intermediate_size == 8 and config.dense_intermediate_size == 32
    assert model.model.layers[0].self_attn.config == config.kda
    slices = rank_slices(model)
    for name, dim, start, stop in (
        ("model.layers.0.self_attn.q_proj.weight", 0, 48, 64),
        ("model.layers.0.self_attn.A_log", 0, 3, 4),
        ("model.layers.0.self_attn.o_proj.weight", 1, 48, 64),
        ("model.layers.3.self_attn.kv_b_proj.weight", 0, 96, 128),
        ("model.layers.1.mlp.experts.w1", 1, 24, 32),
        ("model.layers.1.mlp.experts.w2", 2, 24, 32),
        ("model.layers.0.mlp.down_proj.weight", 1, 96, 128),
    ):
        shard = slices[name]
        assert (shard.dim, shard.start, shard.stop) == (dim, start, stop), name
    assert model.model.layers[0].self_attn.conv_weight.shape == (48, 4)
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" not in slices  # whole
    state = model.empty_state(2)
    assert state.kda[0].recurrent.shape == (2, 1, 16, 16)
