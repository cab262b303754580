"""Loading into a built model, and only slices of tensors (per-rank loading reads through this)."""

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.config import ConfigError
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.loader import CheckpointError, load_checkpoint
from tokenspeed.model.partial_loader import load_checkpoint_into

from .test_loader import _as_mxfp4, _logits


@pytest.fixture(scope="module")
def tiny():
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=11).eval()


@pytest.fixture(scope="module")
def tiny_tied():
    cfg = get_preset("tiny").evolve(tie_word_embeddings=True)
    return init_random_weights(KimiForCausalLM(cfg), seed=12).eval()


# --- loading into a built model, slices of tensors (per-rank loading reads through this) -------


def _meta(config, mxfp4=False):
    from tokenspeed.model.layers.moe import use_mxfp4_experts

    with torch.device("meta"):
        model = KimiForCausalLM(config)
        if mxfp4:
            use_mxfp4_experts(model)
    return model


def _shrink(model, slices):
    """Replace each named tensor of a meta model by a smaller one, its slice's shape."""
    for name, (dim, start, stop) in slices.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        full = getattr(module, attr)
        shape = list(full.shape)
        shape[dim] = stop - start
        part = torch.empty(shape, dtype=full.dtype, device="meta")
        if isinstance(full, torch.nn.Parameter):
            setattr(module, attr, torch.nn.Parameter(part, requires_grad=full.requires_grad))
        else:
            module._buffers[attr] = part
    return model


def _data_bytes(path):
    """Tensor data bytes of every safetensors file: file sizes less their headers."""
    total = 0
    for file in path.glob("*.safetensors"):
        with file.open("rb") as f:
            total += file.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    return total


def test_loading_into_a_meta_model_without_slices_is_load_checkpoint(tiny, tmp_path):

    save_checkpoint(tiny, tmp_path, max_shard_bytes=256 << 10)
    model = _meta(tiny.config)
    stats = load_checkpoint_into(model, tmp_path)
    reference = load_checkpoint(tmp_path)
    for (name, a), (_, b) in zip(
        reference.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(_logits(model.eval()), _logits(tiny))
    # Every byte of tensor data, each once; headers apart.
    assert stats.bytes_read == stats.checkpoint_bytes == _data_bytes(tmp_path)
    assert stats.files == len(list(tmp_path.glob("*.safetensors"))) > 1
    model16 = _meta(tiny.config)
    load_checkpoint_into(model16, tmp_path, dtype="bfloat16")
    assert model16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model16.model.layers[0].self_attn.A_log.dtype == torch.float32


# One slice of each kind of checkpoint tensor: a plain copy along dims 0 and 1, expert stacks
# along dim 0 (whole experts) and dim 2, the KDA conv (three checkpoint tensors) across a part
# boundary and along its kernel dim, A_log's heads, a 1-d norm.
SLICES = {
    "model.embed_tokens.weight": (0, 100, 300),
    "model.layers.0.self_attn.q_proj.weight": (1, 16, 48),
    "model.layers.1.mlp.experts.w1": (0, 4, 12),
    "model.layers.2.mlp.experts.w2": (2, 8, 24),
    "model.layers.0.self_attn.conv_weight": (0, 50, 150),
    "model.layers.1.self_attn.conv_weight": (1, 1, 3),
    "model.layers.2.self_attn.A_log": (0, 1, 3),
    "model.norm.weight": (0, 0, 32),
}


@pytest.mark.parametrize("layout", ["k3", "kimi_linear"])
def test_sliced_loading_reads_exactly_the_slices(tiny, tmp_path, layout):

    save_checkpoint(tiny, tmp_path, layout=layout, max_shard_bytes=256 << 10)
    model = _shrink(_meta(tiny.config), SLICES)
    # max_gap_bytes=0: every range of a slice along a later dim read on its own (exact bytes).
    stats = load_checkpoint_into(model, tmp_path, slices=SLICES, max_gap_bytes=0)
    full = tiny.state_dict()
    state = model.state_dict()
    for name, tensor in state.items():
        want = full[name]
        if name in SLICES:
            dim, start, stop = SLICES[name]
            want = want.narrow(dim, start, stop - start)
        assert torch.equal(tensor, want), name
    expected = sum(t.numel() * t.element_size() for t in state.values())
    assert stats.bytes_read == expected
    saved = sum(full[n].numel() - state[n].numel() for n in SLICES) * 4
    assert stats.checkpoint_bytes - stats.bytes_read == saved


def test_sliced_loading_of_k3_padded_a_log_and_mxfp4_experts(tiny, tmp_path):

    heads, dim = tiny.config.kda.num_heads, tiny.config.kda.head_dim
    packed_model = _as_mxfp4(tiny)

    def edit(tensors, config):
        for name in [n for n in tensors if n.endswith("A_log")]:
            tensors[name] = torch.cat([tensors[name].reshape(-1), torch.zeros(dim - heads)])

    src = save_checkpoint(packed_model, tmp_path / "src", layout="kimi_linear")
    tensors = {}
    for shard in src.glob("*.safetensors"):
        tensors.update(load_file(shard))
    edit(tensors, None)
    dst = tmp_path / "dst"
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())

    slices = {
        "model.layers.0.self_attn.A_log": (0, 2, 4),
        "model.layers.1.mlp.experts.w1_packed": (0, 8, 16),
        "model.layers.1.mlp.experts.w1_scale": (0, 8, 16),
        "model.layers.3.mlp.experts.w3_packed": (1, 0, 16),
    }
    model = _shrink(_meta(tiny.config, mxfp4=True), slices)
    stats = load_checkpoint_into(model, dst, slices=slices, max_gap_bytes=0)
    full = packed_model.state_dict()
    for name, tensor in model.state_dict().items():
        want = full[name]
        if name in slices:
            d, start, stop = slices[name]
            want = want.narrow(d, start, stop - start)
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
    # Unsliced A_log are read whole (with K3's zero padding), so their bytes count too.
    padding = sum(1 for n in tensors if n.endswith("A_log")) - 1
    state = model.state_dict()
    assert (
        stats.bytes_read
        == sum(t.numel() * t.element_size() for t in state.values()) + padding * (dim - heads) * 4
    )


def _span_bytes(shape, dim, start, stop, itemsize=4):
    """Bytes of one read through the holes: from the slice's first byte to its last."""
    inner = math.prod(shape[dim + 1 :]) * itemsize
    outer = math.prod(shape[:dim])
    return ((outer - 1) * shape[dim] + stop - start) * inner if stop - start < shape[dim] else 0


def test_a_slice_along_a_later_dim_is_read_in_spans_and_counted_honestly(
    tiny, tmp_path, monkeypatch
):
    """By default the ranges of a slice along dim > 0 (one per leading index) are read through
    their small holes as one span: few reads, and `bytes_read` counts the holes too."""
    save_checkpoint(tiny, tmp_path, layout="k3", max_shard_bytes=256 << 10)
    slices = {
        "model.layers.0.self_attn.q_proj.weight": (1, 16, 48),  # [64, 64]: 64 ranges
        "model.layers.2.mlp.experts.w2": (2, 8, 24),  # 16 experts of [32, 32]: 16 x 32 ranges
    }
    exact = load_checkpoint_into(
        _shrink(_meta(tiny.config), slices), tmp_path, slices=slices, max_gap_bytes=0
    )
    model = _shrink(_meta(tiny.config), slices)
    stats = load_checkpoint_into(model, tmp_path, slices=slices)
    full = tiny.state_dict()
    for name, tensor in model.state_dict().items():
        want = full[name]
        if name in slices:
            dim, start, stop = slices[name]
            want = want.narrow(dim, start, stop - start)
        assert torch.equal(tensor, want), name
    # The holes read through: q_proj from row 0 col 16 to row 63 col 48; each expert's w2
    # ([32, 32] in the checkpoint, sliced along its dim 1) from row 0 col 8 to row 31 col 24.
    q_span = _span_bytes((64, 64), 1, 16, 48)
    w2_span = 16 * _span_bytes((32, 32), 1, 8, 24)
    q_exact, w2_exact = 64 * 32 * 4, 16 * 32 * 16 * 4
    assert stats.bytes_read - exact.bytes_read == (q_span - q_exact) + (w2_span - w2_exact)
    assert stats.bytes_read <= stats.checkpoint_bytes
    # One read per tensor read (17 instead of 64 + 16 * 32 for these two).
    assert exact.reads - stats.reads == (64 - 1) + 16 * (32 - 1)
    # Spans are bounded (here to 5 ranges of q_proj, 10 of an expert's w2): the same tensors.
    monkeypatch.setattr("tokenspeed.model.partial_loader._MAX_SPAN", 1280)
    bounded = _shrink(_meta(tiny.config), slices)
    few = load_checkpoint_into(bounded, tmp_path, slices=slices)
    for name, tensor in bounded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert few.reads - stats.reads == (13 - 1) + 16 * (4 - 1)


def test_sliced_loading_refuses_bad_slices_and_mismatched_models(tiny, tmp_path):

    save_checkpoint(tiny, tmp_path)
    name = "model.layers.1.mlp.experts.w1"
    with pytest.raises(CheckpointError, match=r"slice of .*w1: \[10, 20\) along dim 0 is outside"):
        load_checkpoint_into(_meta(tiny.config), tmp_path, slices={name: (0, 10, 20)})
    with pytest.raises(CheckpointError, match="slice of model.nothing: no such"):
        load_checkpoint_into(_meta(tiny.config), tmp_path, slices={"model.nothing": (0, 0, 1)})
    # A slice the model's tensor does not have the shape of.
    with pytest.raises(CheckpointError, match=rf"{name}: the model holds shape \[16, 32, 32\]"):
        load_checkpoint_into(_meta(tiny.config), tmp_path, slices={name: (0, 0, 8)})
    with pytest.raises(CheckpointError, match="routed experts are dense, the model's mxfp4"):
        load_checkpoint_into(_meta(tiny.config, mxfp4=True), tmp_path)
    other = tiny.config.evolve(vocab_size=600)
    with pytest.raises(ConfigError, match="the checkpoint's config is not the model's"):
        load_checkpoint_into(_meta(other), tmp_path)


def test_loading_a_tied_model_into_a_meta_model_keeps_it_tied(tiny_tied, tmp_path):

    save_checkpoint(tiny_tied, tmp_path)
    model = _meta(tiny_tied.config)
    slices = {"model.embed_tokens.weight": (0, 0, 256)}
    stats = load_checkpoint_into(_shrink(model, slices), tmp_path, slices=slices)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tiny_tied.lm_head.weight[:256])
    assert stats.bytes_read == stats.checkpoint_bytes - 256 * 64 * 4
