"""Greedy tokens with KDA checkpoints taken every 1, 2 or 3 pages, under several prefill budgets.

A long prefill is cut at every checkpoint position (`step_plan.prefill_pieces`), so the engine
runs it as several forwards where the model's own greedy decoding runs one. Both compute the same
function and differ only in fp32 rounding (~1e-6 in the hidden states: the KDA chunked form over
pieces instead of the whole prompt, GEMMs over fewer rows). On `tiny` that is enough to flip one MoE
routing choice of `tokens(n, seed=3)` for n >= 52: at layer 2, token 51, the 4th and 5th biased
router scores (experts 3 and 0) are 1 fp32 ulp apart (5.7e-8; the next smallest such gap over
six 100-token prompts is 4.3e-6). The one-forward fp32 reference rounds them to a tie and takes
expert 0; the pieces take expert 3, as an fp64 forward does, whole or in pieces. So on `tiny` the
engine is compared with the model's own forward over the same pieces (exact, bit for bit), and
with the one-forward reference only on `steady`, whose routers never come near a tie.
"""

import pytest
import torch

from tokenspeed.model import ForwardBatch
from tokenspeed.runtime import Engine, EngineConfig, SamplingParams

from .conftest import reference, tokens

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Seed 3 from 52 tokens on holds the near-tie at token 51 (the prompts share their prefix).
PROMPTS = [(52, 3), (64, 3), (65, 3), (70, 3), (100, 3), (100, 0), (33, 1)]
INTERVALS = pytest.mark.parametrize("interval", [1, 2, 3])
BUDGETS = pytest.mark.parametrize("budget", [16, 48, 512])


def engine(model, interval, budget):
    return Engine(
        model,
        None,
        EngineConfig(
            device="cpu",
            page_size=16,
            max_num_seqs=4,
            max_model_len=512,
            checkpoint_interval_pages=interval,
            prefill_token_budget=budget,
        ),
    )


def generate(e, prompt):
    """One request alone on a fresh engine: its greedy tokens."""
    e.add_request("r", prompt, GREEDY)
    out = None
    while e.has_unfinished():
        for o in e.step():
            out = o
    e.close()
    return list(out.outputs[0].token_ids)


@INTERVALS
@BUDGETS
def test_greedy_matches_the_model_alone(steady, interval, budget):
    for n, seed in PROMPTS:
        p = tokens(n, seed=seed)
        assert generate(engine(steady, interval, budget), p) == reference(steady, p, MAX_TOKENS), (
            n,
            seed,
        )


@torch.no_grad()
def pieces_reference(model, prompt, pieces):
    """Greedy decoding through the model's own forward, the prompt run in `pieces` [(lo, hi)]."""
    state = model.empty_state(1)
    for lo, hi in pieces:
        batch = ForwardBatch.build([hi - lo], [lo])
        out = model(torch.tensor(prompt[lo:hi]), batch, state, batch.last_token_indices)
        state = out.state
    generated = [out.logits.argmax(-1).item()]
    while len(generated) < MAX_TOKENS:
        batch = ForwardBatch.build([1], state.num_tokens)
        out = model(torch.tensor(generated[-1:]), batch, state)
        state = out.state
        generated.append(out.logits.argmax(-1).item())
    return generated


@INTERVALS
@BUDGETS
def test_greedy_is_the_model_forward_over_the_same_pieces(tiny, interval, budget):
    for n, seed in PROMPTS:
        p = tokens(n, seed=seed)
        e = engine(tiny, interval, budget)
        pieces = []
        forward = e.runner.forward

        def spy(seqs, prefixes, handles, logits_rows=None, forward=forward, pieces=pieces):
            if logits_rows is not None:  # a prefill forward (an eager decode step passes none)
                (seq,), (lo,) = seqs, prefixes
                pieces.append((lo, lo + len(seq)))
            return forward(seqs, prefixes, handles, logits_rows=logits_rows)

        e.runner.forward = spy
        got = generate(e, p)
        assert [lo for lo, _ in pieces] == [0, *(hi for _, hi in pieces[:-1])]
        assert pieces[-1][1] == n
        assert got == pieces_reference(tiny, p, pieces), (n, seed, pieces)
