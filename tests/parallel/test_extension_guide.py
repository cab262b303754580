"""docs/parallel.md's example strategy, run as written on two CPU ranks."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights

from .harness import run_ranks

GUIDE = Path(__file__).parents[2] / "docs" / "parallel.md"


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def _run_guide(rank, world):
    namespace = {"__name__": "guide"}
    for code in _examples():
        exec(compile(code, str(GUIDE), "exec"), namespace)
    reference = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=0)
    ids = torch.tensor([5, 6, 7, 8])
    want = reference(ids, ForwardBatch.build([4]), reference.empty_state(1)).logits
    head = namespace["model"].lm_head.weight.shape
    strategies = [r.strategy for r in namespace["reports"]]
    return (namespace["out"].logits - want).abs().max().item(), tuple(head), strategies


def test_the_guides_strategy_runs_as_written():
    assert len(_examples()) == 2
    vocab, hidden = get_preset("tiny").vocab_size, get_preset("tiny").hidden_size
    for diff, head, strategies in run_ranks(_run_guide, 2):
        assert diff < 5e-5
        assert head == (vocab // 2, hidden)  # the rank keeps half the vocabulary
        assert strategies == ["tp_subgroup", "vocab_head", "dep"]
