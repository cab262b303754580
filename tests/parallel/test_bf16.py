"""bf16 activations: DEP's combine travels in bf16 and TEP's all-reduce runs in bf16; an MoE
layer of either gives the single-process bf16 layer's output within bf16 rounding.

Layers, not logits: the random tiny model is ill-conditioned in bf16 (its bf16 logits are tens
of percent from its fp32 ones, routing flips included), so a whole-model comparison would only
say "bf16 is noisy". On one MoE layer the router is the same computation on the same bf16
input in both, so the routing agrees, and what differs is where the bf16 roundings happen:
DEP rounds each rank's partial sum to bf16 before the combine, TEP sums bf16 halves. Each costs
about one unit in the last place (2^-8 of the value) of the output per rounding; the bound is
4 of them relative to the layer's largest output (seen: up to 0.8%, i.e. 2 units).
"""

from __future__ import annotations

import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel import CommLog, ParallelDims, ParallelGroups, apply_dep, apply_tp

from .harness import run_ranks

BF16_RTOL = 4 * 2**-8


def _tiny(dtype: torch.dtype) -> KimiForCausalLM:
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0).to(dtype)


def _bf16(rank, world):
    dep_groups = ParallelGroups.build(ParallelDims(world_size=world, ep=world))
    tep_groups = ParallelGroups.build(ParallelDims(world_size=world, tep=world))
    ref, dep, tep = (_tiny(torch.bfloat16) for _ in range(3))
    log = CommLog()
    apply_dep(dep, dep_groups, log=log)
    apply_tp(tep, tep_groups, log=log)
    out = {}
    # DEP: this rank's own tokens (a different count on each rank); TEP: the same on every rank.
    for name, model, rows, seed in (("dep", dep, 7 + 4 * rank, rank), ("tep", tep, 9, 9)):
        errors = []
        for layer in (1, 3, 8):
            gen = torch.Generator().manual_seed(seed + layer)
            x = torch.randn(rows, 64, generator=gen).bfloat16()
            want = ref.model.layers[layer].mlp(x)
            got = model.model.layers[layer].mlp(x)
            assert got.dtype == want.dtype == torch.bfloat16
            diff = (got.float() - want.float()).abs().max().item()
            errors.append(diff / want.float().abs().max().item())
        out[name] = errors
    return out, dict(log.sent)


def test_bf16_dep_combine_and_tep_all_reduce_match_the_bf16_model():
    for out, sent in run_ranks(_bf16, 2, timeout=240):
        assert sent["dep.combine"] > 0 and sent["tep.mlp.all_reduce"] > 0
        for name, errors in out.items():
            assert max(errors) <= BF16_RTOL, (name, errors)
