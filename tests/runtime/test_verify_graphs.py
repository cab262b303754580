"""`VerifyGraphs` on the CPU: the padded verify steps a captured graph replays, run eagerly
(capture=False, as a GPU engine's eager mode runs them). Every row is fed k + 1 tokens, those
with fewer drafts padded; the outputs stay the plain engine's, acceptance is the proposer's,
and the cache stays consistent. The captured graphs themselves: tests/runtime/test_spec_gpu.py."""

import tempfile

import attrs
import pytest

from tokenspeed.runtime.runner import VerifyStep
from tokenspeed.runtime.spec import SpeculativeConfig
from tokenspeed.runtime.verify_graphs import VerifyGraphs

from .conftest import reference, tiny_model, tokens
from .spec.helpers import drafter_config, write_drafter
from .test_spec_engine import GREEDY, Oracle, engine, run


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def requests(model):
    # Lengths that put windows against page boundaries (page 16) in every phase.
    prompts = {i: tokens(n, 300 + i) for i, n in enumerate([5, 17, 30, 46])}
    return prompts, {i: reference(model, p, 40) for i, p in prompts.items()}


def with_graphs(e, sizes=(1, 2, 4)) -> list[list[int]]:
    """Give engine `e`'s runner eager `VerifyGraphs` of `sizes`; returns a log of the real
    window lengths of every step they ran."""
    runner, spec = e.runner, e.config.speculative
    graphs = VerifyGraphs(
        runner,
        sizes,
        spec.num_steps + 1,
        e.config.max_pages_per_request,
        capture=False,
        aux_layers=runner.aux_layers,
    )
    log = []
    real = graphs.run

    def logged(tokens, prefix_lens, handles):
        log.append([len(t) for t in tokens])
        return real(tokens, prefix_lens, handles)

    graphs.run = logged
    runner.verify_graphs = graphs
    return log


def test_padded_windows_give_the_reference_and_accept_every_oracle_draft(model, requests):
    prompts, outputs = requests
    e = engine(model, SpeculativeConfig(num_steps=3))
    e.proposer = Oracle(prompts, outputs)
    log = with_graphs(e)
    # Request 0 ends early: later steps have three rows, padded to four.
    short = attrs.evolve(GREEDY, max_tokens=21)
    got = run(e, [(i, p, short if i == 0 else GREEDY) for i, p in prompts.items()])
    assert got == {**outputs, 0: outputs[0][:21]}
    # Every verify step went through the graphs, some with windows shorter than k + 1
    # (padded) and some with fewer rows than the padded size.
    assert len(log) > 0
    assert any(min(lens) < 4 for lens in log)
    assert any(len(lens) == 3 for lens in log)
    m = e.metrics
    assert m.acceptance_rates == [1.0] * 3 and m.mean_acceptance_length > 3.0
    assert m.spec_emitted_tokens == m.spec_verify_rows + sum(m.spec_proposed)
    e.check_integrity()


def test_rejected_drafts_and_padding_leave_no_trace(model, requests):
    prompts, outputs = requests
    e = engine(model, SpeculativeConfig(num_steps=2))
    e.proposer = Oracle(prompts, outputs, wrong=True)
    log = with_graphs(e)
    assert run(e, [(i, p, GREEDY) for i, p in prompts.items()]) == outputs
    assert log and e.metrics.mean_acceptance_length == 1.0
    e.check_integrity()


def test_batches_past_the_largest_size_run_eagerly(model, requests):
    """Graph sizes up to 2 with four requests: steps of three or four rows take the eager
    packed path, the others the padded one; the same tokens either way."""
    prompts, outputs = requests
    e = engine(model, SpeculativeConfig(num_steps=3))
    e.proposer = Oracle(prompts, outputs)
    log = with_graphs(e, sizes=(1, 2))
    steps = []
    real = e.runner.verify

    def counted(tokens, prefix_lens, handles):
        steps.append(len(tokens))
        return real(tokens, prefix_lens, handles)

    e.runner.verify = counted
    # Requests end one after another: steps of four, three, two and one rows.
    lengths = {i: 10 * (i + 1) for i in prompts}
    got = run(e, [(i, p, attrs.evolve(GREEDY, max_tokens=lengths[i])) for i, p in prompts.items()])
    assert got == {i: outputs[i][: lengths[i]] for i in prompts}
    assert log and all(len(lens) <= 2 for lens in log)
    assert len(steps) == len(log) + sum(n > 2 for n in steps)  # the others ran eagerly
    assert any(n > 2 for n in steps)
    e.check_integrity()


def test_eagle3_drafter_reads_the_padded_steps_states(model, requests):
    """EAGLE3 verifies every step (rows without drafts: windows of one token, padded here);
    the drafter is handed the kept rows' auxiliary states out of the padded step."""
    prompts, outputs = requests
    with tempfile.TemporaryDirectory(prefix="eagle3-") as root:
        path = write_drafter(f"{root}/drafter", drafter_config(), model.model.embed_tokens)
        spec = SpeculativeConfig(method="eagle3", draft_model=path, num_steps=3)
        e = engine(model, spec, max_model_len=200)
        log = with_graphs(e)
        assert run(e, [(i, p, GREEDY) for i, p in prompts.items()]) == outputs
    assert log and any(1 in lens for lens in log)
    assert e.metrics.spec_verify_rows > 0
    e.check_integrity()


def test_strided_step_rows():
    step = VerifyStep(None, [2, 4, 1], None, {}, stride=4)
    assert [step.rows(i) for i in range(3)] == [slice(0, 2), slice(4, 8), slice(8, 9)]
    packed = VerifyStep(None, [2, 4, 1], None, {})
    assert [packed.rows(i) for i in range(3)] == [slice(0, 2), slice(2, 6), slice(6, 7)]


def test_width_and_window_lengths_are_checked(model):
    e = engine(model, SpeculativeConfig(num_steps=1))
    with pytest.raises(ValueError, match="1..4 tokens"):
        VerifyGraphs(e.runner, (1,), 5, 8, capture=False)
    graphs = VerifyGraphs(e.runner, (1,), 2, 8, capture=False)
    assert graphs.fits(1, [8 * 16 - 2]) and not graphs.fits(1, [8 * 16 - 1])
    assert not graphs.fits(2, [0, 0])
    with pytest.raises(ValueError, match="1..2 tokens"):
        graphs.run([[1, 2, 3]], [0], [])
