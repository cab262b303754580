"""Whole-model parity with transformers' KimiLinearForCausalLM, loaded through our loader."""

import pytest
import torch

from tokenspeed.model import ForwardBatch
from tokenspeed.model.generate import greedy_generate
from tokenspeed.model.loader import load_checkpoint

from .hf_kimi_linear import save_tiny_kimi_linear

VARIANTS = {
    "kimi-linear": {},
    # A q LoRA and grouped routing: the code paths K3-sized Kimi checkpoints take.
    "q-lora-grouped-router": dict(q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=3),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_kimi_linear(path, seed=7, **VARIANTS[request.param])
    ours = load_checkpoint(path, dtype=torch.float32)
    return hf, ours


def test_logits_match_on_a_packed_batch_of_different_lengths(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(0)
    lengths = [37, 5, 80, 1, 129]
    seqs = [torch.randint(3, 256, (n,), generator=gen) for n in lengths]
    batch = ForwardBatch.build(lengths)
    logits = ours(torch.cat(seqs), batch, ours.empty_state(len(lengths))).logits
    for seq, (_, seg) in zip(seqs, batch.segments(), strict=True):
        with torch.no_grad():
            expected = hf(input_ids=seq[None]).logits[0]
        assert (logits[seg] - expected).abs().max().item() <= 1e-4


def test_greedy_continuation_matches(pair):
    hf, ours = pair
    prompt = torch.tensor([5, 17, 99, 3, 250, 41, 8, 77, 120, 64, 9])
    with torch.no_grad():
        expected = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            min_new_tokens=32,
        )[0, len(prompt) :]
    got = greedy_generate(ours, [prompt.tolist()], max_new_tokens=32, stop_token_ids=())[0]
    assert got == expected.tolist()
    assert len(set(got)) > 3  # a continuation that varies, not one repeated token
