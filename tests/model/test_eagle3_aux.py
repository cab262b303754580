"""The target's auxiliary hidden states for EAGLE3 (`aux_hidden_layers`): what they hold, and that
asking for them changes nothing else."""

import pytest
import torch

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.batch import BatchError
from tokenspeed.model.eagle3 import default_aux_layers
from tokenspeed.model.init import init_random_weights

from .conftest import kimi_linear_like


@pytest.fixture(scope="module", params=["tiny", "kimi-linear-like"])
def target(request):
    config = get_preset("tiny") if request.param == "tiny" else kimi_linear_like()
    return init_random_weights(KimiForCausalLM(config), seed=12).eval()


def _inputs(model, lens=(7, 1, 4), prefix=None):
    total = sum(lens)
    ids = torch.randint(
        0, model.config.vocab_size, (total,), generator=torch.Generator().manual_seed(2)
    )
    return ids, ForwardBatch.build(lens, prefix)


def _hooked(model, ids, batch, state):
    """What each layer's input norm reads (the residual stream entering it, or with attention
    residuals the mix it reads) and what the output norm reads, from forward hooks."""
    seen = {}
    handles = [
        layer.input_layernorm.register_forward_pre_hook(
            lambda _m, args, i=layer.index: seen.__setitem__(i, args[0].clone())
        )
        for layer in model.model.layers
    ]
    n = model.config.num_layers
    handles.append(
        model.model.norm.register_forward_pre_hook(
            lambda _m, args: seen.__setitem__(n, args[0].clone())
        )
    )
    try:
        out = model(ids, batch, state)
    finally:
        for h in handles:
            h.remove()
    return out, seen


def test_aux_states_are_the_layer_inputs_and_change_nothing_else(target):
    ids, batch = _inputs(target)
    n = target.config.num_layers
    points = (*default_aux_layers(n), 0, n)
    plain, seen = _hooked(target, ids, batch, target.empty_state(3))
    got = target(ids, batch, target.empty_state(3), aux_hidden_layers=points)
    assert plain.aux_hidden is None
    assert torch.equal(got.logits, plain.logits)
    for layer in plain.state.kda:
        assert torch.equal(got.state.kda[layer].recurrent, plain.state.kda[layer].recurrent)
    d = target.config.hidden_size
    assert got.aux_hidden.shape == (ids.numel(), len(points) * d)
    for j, point in enumerate(points):
        assert torch.equal(got.aux_hidden[:, j * d : (j + 1) * d], seen[point]), point
    # Layer 0 reads the embedding.
    assert torch.equal(got.aux_hidden[:, 3 * d : 4 * d], target.model.embed_tokens(ids))


def test_aux_states_cover_every_token_whatever_logits_are_selected(target):
    ids, batch = _inputs(target)
    points = default_aux_layers(target.config.num_layers)
    full = target(ids, batch, target.empty_state(3), aux_hidden_layers=points)
    last = target(
        ids,
        batch,
        target.empty_state(3),
        logits_indices=batch.last_token_indices,
        aux_hidden_layers=points,
    )
    assert last.logits.shape[0] == 3 and torch.equal(last.aux_hidden, full.aux_hidden)
    torch.testing.assert_close(last.logits, full.logits[batch.last_token_indices])


def test_aux_states_of_a_decode_step_continue_the_prefill(target):
    """Prefill 6 tokens then decode 1: the decode step's states equal the 7th row of one
    7-token prefill (the capture follows the state, not the step's shape)."""
    ids = torch.randint(
        0, target.config.vocab_size, (7,), generator=torch.Generator().manual_seed(5)
    )
    points = default_aux_layers(target.config.num_layers)
    whole = target(ids, ForwardBatch.build([7]), target.empty_state(), aux_hidden_layers=points)
    first = target(ids[:6], ForwardBatch.build([6]), target.empty_state(), aux_hidden_layers=points)
    step = target(ids[6:], ForwardBatch.build([1], [6]), first.state, aux_hidden_layers=points)
    torch.testing.assert_close(first.aux_hidden, whole.aux_hidden[:6], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.aux_hidden, whole.aux_hidden[6:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("points", "words"),
    [
        ((), "non-empty"),
        ((2, 2, 3), "repeats"),
        ((2, 10), "outside 0..9"),
        ((-1,), "outside"),
        ((True, 2), "not an integer"),
        ((2.0,), "not an integer"),
        ("123", "non-empty sequence"),
    ],
)
def test_bad_capture_points_are_refused(tiny_model, points, words):
    ids, batch = _inputs(tiny_model)
    with pytest.raises(BatchError, match=words):
        tiny_model(ids, batch, tiny_model.empty_state(3), aux_hidden_layers=points)


FUSED = r"""
import json
import torch
torch.set_num_threads(1)
from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.ops import dispatch
from tokenspeed.runtime.llm import _keep_fp32

model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=8).half()
_keep_fp32(model)
ids = torch.randint(3, 512, (6,), generator=torch.Generator().manual_seed(1))
batch = ForwardBatch.build([4, 2])
fused = dispatch.half_kernels(model.model.embed_tokens(ids))
got = model(ids, batch, model.empty_state(2), aux_hidden_layers=(0, 2, 4, 6, 9))
plain = model(ids, batch, model.empty_state(2))
print(json.dumps({"fused": fused, "same_logits": torch.equal(got.logits, plain.logits),
                  "aux": got.aux_hidden.float().tolist()}))
"""


def test_the_fused_attn_res_path_captures_the_same_states():
    """fp16 under Triton's interpreter takes the fused AttnRes stream, which never writes the
    pre-norm mix out: its capture (the reference mix of the bank) matches the reference path's,
    and its logits are those of the same forward without capture."""
    import json
    import os
    import subprocess
    import sys

    from tokenspeed.runtime.llm import _keep_fp32

    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", FUSED], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fused"] and result["same_logits"]
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=8).half()
    _keep_fp32(model)
    ids = torch.randint(3, 512, (6,), generator=torch.Generator().manual_seed(1))
    want = model(
        ids, ForwardBatch.build([4, 2]), model.empty_state(2), aux_hidden_layers=(0, 2, 4, 6, 9)
    ).aux_hidden.float()
    got = torch.tensor(result["aux"])
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
