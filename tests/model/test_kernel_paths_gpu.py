"""On a GPU in bf16 the model's Triton paths (fused AttnRes stream, router + grouped experts,
shared-expert side stream, KDA tail) must compute the same function as the torch references
that run on the CPU."""

import pytest
import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.moe import MoE, Mxfp4Experts

pytestmark = pytest.mark.gpu


def _cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), 0).item()


def _check_against_cpu(model, overlap=False):
    lengths = [40, 7, 1, 90]
    ids = torch.randint(3, 512, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    batch = ForwardBatch.build(lengths)
    exact = model(ids, batch, model.empty_state(len(lengths))).logits.float()
    model = model.bfloat16()
    for name, p in model.named_parameters():  # as the loader keeps them
        if name.endswith(("A_log", "dt_bias", "mlp.gate.weight")):
            p.data = p.data.float()
    cpu_bf16 = model(ids, batch, model.empty_state(len(lengths))).logits.float()
    model = model.cuda()
    model.overlap_shared_experts(overlap)
    got = (
        model(
            ids.cuda(), ForwardBatch.build(lengths, device="cuda"), model.empty_state(len(lengths))
        )
        .logits.float()
        .cpu()
    )
    floor = _cosine(cpu_bf16, exact)
    assert _cosine(got, exact) > floor - 0.05, (_cosine(got, exact), floor)
    assert _cosine(got, exact) > 0.8  # a wrong kernel gives ~0


@pytest.mark.parametrize("overlap", [False, True])
def test_gpu_kernel_paths_match_cpu_reference(overlap):
    """bf16 kernels on the GPU are as close to the fp32 model as the bf16 CPU references are.

    (bf16 rounding and the expert flips it causes in this random router move logits a lot: on
    the first H200 run kernels vs CPU bf16 references gave cosine 0.93, which is bf16 noise, as
    tests/model/test_kernel_paths_interpreted.py shows in fp16 with cosine 1.0000.)"""
    _check_against_cpu(init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=8), overlap)


def test_gpu_mxfp4_experts_match_cpu_reference():
    """MXFP4 experts (as a K3 checkpoint loads them): the grouped kernels read them packed;
    the CPU reference decodes them, so it is the same function."""
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=8)
    for module in model.modules():
        if isinstance(module, MoE):
            module.experts = Mxfp4Experts.quantize(module.experts)
    _check_against_cpu(model)
    assert model.model.layers[1].mlp.experts.w1_packed.dtype == torch.uint8
