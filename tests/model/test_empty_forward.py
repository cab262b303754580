"""A forward over no requests: what an idle rank runs so that the collectives of parallel
transforms inside the layers happen in the same order on every rank."""

import pytest
import torch

from tokenspeed.model import DecoderState, ForwardBatch, PagedKda, PagedMla, PagedState
from tokenspeed.model.layers.decoder import DecoderLayer
from tokenspeed.model.layers.moe import MoE


def _no_tokens():
    return torch.zeros(0, dtype=torch.long)


def _paged_state(model, rows=0, slots=4, pages=6, page_size=8, seed=0):
    """Pools holding garbage, and a page table / slot list of `rows` requests."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    return PagedState(
        kda={
            i: PagedKda(
                torch.randn(slots, cfg.kda.conv_channels, cfg.kda.conv_kernel - 1, generator=gen),
                torch.randn(
                    slots, cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.head_dim, generator=gen
                ),
                torch.zeros(rows, dtype=torch.long),
            )
            for i in cfg.kda_layers
        },
        mla={
            i: PagedMla(
                torch.randn(pages, page_size, cfg.mla.latent_width, generator=gen),
                torch.zeros(rows, 2, dtype=torch.long),
            )
            for i in cfg.mla_layers
        },
    )


def _pool_tensors(state: PagedState) -> list[torch.Tensor]:
    return [
        *(t for k in state.kda.values() for t in (k.conv, k.recurrent, k.slots)),
        *(t for m in state.mla.values() for t in (m.pages, m.page_table)),
    ]


def _assert_same_decoder_state(new: DecoderState, old: DecoderState):
    assert new.num_tokens == old.num_tokens == []
    assert new.kda.keys() == old.kda.keys() and new.mla.keys() == old.mla.keys()
    for i, s in old.kda.items():
        for a, b in ((new.kda[i].conv, s.conv), (new.kda[i].recurrent, s.recurrent)):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    for i, rows in old.mla.items():
        assert new.mla[i] == rows == []


@pytest.mark.parametrize("with_indices", [False, True])
def test_empty_forward_over_explicit_state(model, with_indices):
    batch = ForwardBatch.build(seq_lens=[], prefix_lens=[])
    state = model.empty_state(0)
    before = state.clone()
    indices = batch.last_token_indices if with_indices else None
    out = model(_no_tokens(), batch, state, logits_indices=indices)
    assert out.logits.shape == (0, model.config.vocab_size)
    assert out.logits.dtype == model.lm_head.weight.dtype
    _assert_same_decoder_state(out.state, before)
    _assert_same_decoder_state(state, before)
    # The state an idle step hands back is a valid state of no requests.
    again = model(_no_tokens(), batch, out.state)
    _assert_same_decoder_state(again.state, before)


def test_empty_forward_over_paged_state(model):
    state = _paged_state(model)
    before = [t.clone() for t in _pool_tensors(state)]
    out = model(_no_tokens(), ForwardBatch.build([]), state)
    assert out.logits.shape == (0, model.config.vocab_size)
    assert out.state is state
    after = _pool_tensors(state)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def _called_modules(model, run) -> set[str]:
    """Qualified names of the modules whose forward ran during `run()` (forward hooks)."""
    called: set[str] = set()

    def hook(name):
        def record(module, args, output):
            called.add(name)

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return called


def test_every_module_runs_on_no_tokens(tiny_model):
    """Parallel transforms communicate inside the layers' modules, so an idle rank must call
    each of them, as a rank with tokens does (only with 0-row tensors)."""
    model = tiny_model
    shapes: dict[str, tuple[int, ...]] = {}

    def record_shapes(prefix):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            shapes[prefix] = tuple(out.shape)

        return hook

    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    assert len(layers) == model.config.num_layers
    moes = [layer.mlp for layer in layers if isinstance(layer.mlp, MoE)]
    assert moes, "the tiny preset has MoE layers"
    handles = [
        layer.self_attn.register_forward_hook(record_shapes(f"attn{i}"))
        for i, layer in enumerate(layers)
    ]
    handles += [
        layer.mlp.register_forward_hook(record_shapes(f"mlp{i}")) for i, layer in enumerate(layers)
    ]
    try:
        empty = _called_modules(
            model, lambda: model(_no_tokens(), ForwardBatch.build([]), model.empty_state(0))
        )
        paged = _called_modules(
            model, lambda: model(_no_tokens(), ForwardBatch.build([]), _paged_state(model))
        )
    finally:
        for h in handles:
            h.remove()
    for i in range(len(layers)):
        assert shapes[f"attn{i}"] == (0, model.config.hidden_size)
        assert shapes[f"mlp{i}"] == (0, model.config.hidden_size)
    ids = torch.arange(3, 10)
    busy = _called_modules(
        model, lambda: model(ids, ForwardBatch.build([4, 3]), model.empty_state(2))
    )
    assert empty == busy and paged == busy
    for layer in layers:
        for part in ("self_attn", "mlp"):
            assert f"model.layers.{layer.index}.{part}" in empty
    for moe in moes:
        name = next(n for n, m in model.named_modules() if m is moe)
        for part in ("gate", "experts", "shared_experts", "routed_expert_down_proj"):
            assert f"{name}.{part}" in empty
