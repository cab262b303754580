"""Causal short conv: prefill form, one-step form and their state hand-off."""

import torch
import torch.nn.functional as F

from tokenspeed.model.ops.conv import causal_conv, causal_conv_update


def _data(steps=30, channels=6, width=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(steps, channels, generator=gen), torch.randn(channels, width, generator=gen)


def test_prefill_matches_padded_conv1d():
    x, w = _data()
    y, state = causal_conv(x, w)
    ref = F.conv1d(x.t()[None], w[:, None], padding=w.shape[1] - 1, groups=x.shape[1])
    ref = F.silu(ref[0, :, : x.shape[0]].t())
    assert torch.allclose(y, ref, atol=1e-6)
    assert torch.equal(state, x[-3:].t())


def test_updates_continue_a_prefill_exactly():
    x, w = _data()
    full, full_state = causal_conv(x, w)
    y, state = causal_conv(x[:10], w)
    outs = [y]
    for t in range(10, 30):
        step, state = causal_conv_update(x[t][None], state[None], w)
        state = state[0]
        outs.append(step)
    assert torch.allclose(torch.cat(outs), full, atol=1e-6)
    assert torch.equal(state, full_state)


def test_short_chunks_shorter_than_the_window():
    x, w = _data(steps=7)
    full, full_state = causal_conv(x, w)
    state, outs = None, []
    for start in range(0, 7, 2):
        y, state = causal_conv(x[start : start + 2], w, state)
        outs.append(y)
    assert torch.allclose(torch.cat(outs), full, atol=1e-6)
    assert torch.equal(state, full_state)


def test_update_does_not_modify_its_inputs():
    x, w = _data()
    state = torch.randn(2, 6, 3)
    before = state.clone()
    causal_conv_update(x[:2], state, w)
    assert torch.equal(state, before)
