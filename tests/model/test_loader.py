"""Checkpoint loading and saving in the Hugging Face layout."""

import copy
import json

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.config import ConfigError
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.moe import MoE, Mxfp4Experts
from tokenspeed.model.loader import INDEX_FILE, CheckpointError, load_checkpoint
from tokenspeed.model.ops.moe.mxfp4 import quantize_mxfp4


@pytest.fixture(scope="module")
def tiny():
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=11).eval()


def _logits(model, n=40, seed=0):
    ids = torch.randint(
        0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    )
    return model(ids, ForwardBatch.build([n]), model.empty_state()).logits


@pytest.mark.parametrize("layout", ["k3", "kimi_linear"])
def test_tiny_k3_round_trips_with_identical_outputs(tiny, tmp_path, layout):
    save_checkpoint(tiny, tmp_path, layout=layout, max_shard_bytes=256 << 10)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    prefix = "language_model." if layout == "k3" else ""
    assert f"{prefix}model.layers.1.block_sparse_moe.experts.15.w2.weight" in index
    assert f"{prefix}model.layers.0.self_attn.q_conv1d.weight" in index
    assert f"{prefix}model.layers.4.self_attention_res_proj.weight" in index
    assert f"{prefix}model.output_attn_res_norm.weight" in index
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == tiny.config
    assert torch.equal(_logits(loaded), _logits(tiny))
    for (name, a), (_, b) in zip(
        tiny.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_dtype_choice_keeps_decay_rates_and_router_in_fp32(tiny, tmp_path):
    save_checkpoint(tiny, tmp_path)
    model = load_checkpoint(tmp_path, dtype="bfloat16")
    layers = model.model.layers
    assert layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert layers[1].mlp.experts.w1.dtype == torch.bfloat16
    assert layers[0].self_attn.A_log.dtype == torch.float32
    assert layers[0].self_attn.dt_bias.dtype == torch.float32
    assert layers[1].mlp.gate.weight.dtype == torch.float32
    assert layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    out = _logits(model)
    assert out.dtype == torch.bfloat16
    # bf16 rounding (and the expert-selection flips it causes in a random model, whose router
    # has no margins) moves logits, but they stay those of the same model: compare directions.
    # Unrelated logits have cosine ~0.
    reference = _logits(tiny).flatten()
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), reference, 0) > 0.8
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_checkpoint(tmp_path, dtype="float8")


def _flat(tmp_path, tiny, edit):
    """Save tiny, then rewrite it as one flat file after `edit(tensors, config)`."""
    src = tmp_path / "src"
    save_checkpoint(tiny, src, layout="kimi_linear")
    tensors = {}
    for shard in src.glob("*.safetensors"):
        tensors.update(load_file(shard))
    config = json.loads((src / "config.json").read_text())
    edit(tensors, config)
    dst = tmp_path / "dst"
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_errors_list_missing_unexpected_and_mis_shaped_tensors_by_name(tiny, tmp_path):
    def edit(tensors, config):
        del tensors["model.layers.2.self_attn.k_conv1d.weight"]
        del tensors["model.layers.5.block_sparse_moe.experts.7.w3.weight"]
        tensors["model.layers.0.self_attn.unknown.weight"] = torch.zeros(3)
        tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(5, 5)

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(_flat(tmp_path, tiny, edit))
    err = info.value
    assert err.missing == [
        "model.layers.2.self_attn.k_conv1d.weight",
        "model.layers.5.block_sparse_moe.experts.7.w3.weight",
    ]
    assert err.unexpected == ["model.layers.0.self_attn.unknown.weight"]
    assert len(err.mis_shaped) == 1 and "model.layers.3.self_attn.kv_b_proj.weight" in str(err)
    assert "shape [5, 5], expected [128, 32]" in str(err)


def test_non_strict_load_ignores_unexpected_tensors(tiny, tmp_path):
    def edit(tensors, config):
        tensors["model.mtp.0.weight"] = torch.zeros(2)

    path = _flat(tmp_path, tiny, edit)
    with pytest.raises(CheckpointError, match="model.mtp.0.weight"):
        load_checkpoint(path)
    assert torch.equal(_logits(load_checkpoint(path, strict=False)), _logits(tiny))


def test_k3_multimodal_towers_are_skipped_and_padded_a_log_accepted(tiny, tmp_path):
    heads, dim = tiny.config.kda.num_heads, tiny.config.kda.head_dim

    def edit(tensors, config):
        for name in [n for n in tensors if n.endswith("A_log")]:
            tensors[name] = torch.cat([tensors[name].reshape(-1), torch.zeros(dim - heads)])
        tensors["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)

    assert torch.equal(_logits(load_checkpoint(_flat(tmp_path, tiny, edit))), _logits(tiny))


def test_a_log_padding_must_be_zero(tiny, tmp_path):
    def edit(tensors, config):
        name = "model.layers.0.self_attn.A_log"
        tensors[name] = torch.cat([tensors[name].reshape(-1), torch.ones(3)])

    with pytest.raises(CheckpointError, match="A_log: has 7 entries for 4 heads"):
        load_checkpoint(_flat(tmp_path, tiny, edit))


def test_other_quantized_checkpoints_are_refused_with_a_reason(tiny, tmp_path):
    def edit(tensors, config):
        config["quantization_config"] = {"format": "float-quantized"}

    with pytest.raises(CheckpointError, match="quantized checkpoints .float-quantized."):
        load_checkpoint(_flat(tmp_path, tiny, edit))


def _as_mxfp4(model):
    """A copy of `model` whose routed experts are rounded to MXFP4 (Mxfp4Experts)."""
    out = copy.deepcopy(model)
    for module in out.modules():
        if isinstance(module, MoE):
            module.experts = Mxfp4Experts.quantize(module.experts)
    return out


def test_k3_style_mxfp4_experts_load_packed(tiny, tmp_path):
    # A checkpoint written the way compressed-tensors names MXFP4 (weight_packed / weight_scale
    # per expert, the format under config_groups as K3's config.json has it), not through our
    # own writer: the experts stay uint8 and compute as their decoded values.
    packed_model = _as_mxfp4(tiny)

    def edit(tensors, config):
        for name in [n for n in tensors if ".experts." in n and n.endswith(".weight")]:
            packed, scale = quantize_mxfp4(tensors.pop(name))
            tensors[name + "_packed"] = packed
            tensors[name + "_scale"] = scale
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "group_0": {"format": "mxfp4-pack-quantized", "targets": ["re:.*experts.*"]}
            },
        }

    loaded = load_checkpoint(_flat(tmp_path, tiny, edit), dtype="bfloat16")
    experts = loaded.model.layers[1].mlp.experts
    assert isinstance(experts, Mxfp4Experts)
    e, inter, width = tiny.model.layers[1].mlp.experts.w1.shape
    assert experts.w1_packed.dtype == torch.uint8
    assert experts.w1_packed.shape == (e, inter, width // 2)
    assert experts.w2_scale.shape == (e, width, inter // 32)
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    want = packed_model.model.layers[1].mlp.experts
    for name in ("w1", "w2", "w3"):
        for kind in ("packed", "scale"):
            attr = f"{name}_{kind}"
            assert torch.equal(getattr(experts, attr), getattr(want, attr)), attr
    # fp32 load: the same function as the dense model holding the decoded weights.
    loaded32 = load_checkpoint(tmp_path / "dst", dtype="float32")
    decoded = copy.deepcopy(tiny)
    for mine, theirs in zip(decoded.modules(), loaded32.modules(), strict=True):
        if isinstance(mine, MoE):
            for name, w in zip(
                ("w1", "w2", "w3"), theirs.experts.decoded(torch.float32), strict=True
            ):
                getattr(mine.experts, name).data.copy_(w)
    assert torch.equal(_logits(loaded32), _logits(decoded))
    assert not torch.equal(_logits(loaded32), _logits(tiny))  # the rounding is real


def test_mxfp4_models_round_trip_through_save(tiny, tmp_path):
    model = _as_mxfp4(tiny)
    save_checkpoint(model, tmp_path, layout="k3")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed" in index
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight" not in index
    loaded = load_checkpoint(tmp_path)
    assert torch.equal(_logits(loaded), _logits(model))
    for (name, a), (_, b) in zip(
        model.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_mxfp4_packed_tensors_must_be_uint8(tiny, tmp_path):
    model = _as_mxfp4(tiny)
    src = save_checkpoint(model, tmp_path / "src", layout="kimi_linear")
    tensors = {}
    for shard in src.glob("*.safetensors"):
        tensors.update(load_file(shard))
    bad = "model.layers.1.block_sparse_moe.experts.2.w1.weight_scale"
    tensors[bad] = tensors[bad].float()
    dst = tmp_path / "dst"
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(CheckpointError, match="experts.2.w1.weight_scale: packed MXFP4 must be"):
        load_checkpoint(dst)


def test_empty_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    with pytest.raises(Exception, match="lacks|no \\*.safetensors"):
        load_checkpoint(tmp_path)


def _sharded(tmp_path, tiny):
    """Save tiny in several shards with an index; returns the directory and the shard files."""
    save_checkpoint(tiny, tmp_path, max_shard_bytes=256 << 10)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2
    return tmp_path, shards


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_missing_and_truncated_shards_are_reported_together_by_file(tiny, tmp_path):
    path, shards = _sharded(tmp_path, tiny)
    shards[1].unlink()
    _truncate(shards[2])
    index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    in_lost_shards = {n for n, f in index.items() if f in (shards[1].name, shards[2].name)}
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    err = info.value
    assert f"{shards[1].name}: no such file (the index places" in str(err)
    assert f"{shards[2].name}: unreadable" in str(err)
    # the tensors those files hold are the model's missing ones
    assert len(err.missing) == len(in_lost_shards)
    assert all(f"language_model.{name}" in in_lost_shards for name in err.missing)


def test_an_unreadable_shard_without_an_index_is_reported_by_file(tiny, tmp_path):
    path, shards = _sharded(tmp_path, tiny)
    (path / INDEX_FILE).unlink()
    _truncate(shards[0])
    with pytest.raises(CheckpointError, match=f"{shards[0].name}: unreadable"):
        load_checkpoint(path)


def test_an_index_placing_a_tensor_in_the_wrong_file_names_both(tiny, tmp_path):
    path, shards = _sharded(tmp_path, tiny)
    index = json.loads((path / INDEX_FILE).read_text())
    name = "language_model.model.embed_tokens.weight"
    wrong = next(s.name for s in shards if s.name != index["weight_map"][name])
    index["weight_map"][name] = wrong
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert f"{name}: not in {wrong}, where the index places it" in str(info.value)
    assert info.value.missing == ["model.embed_tokens.weight"]


@pytest.mark.parametrize("index", [{"metadata": {}}, {"weight_map": [1, 2]}, [], "{not json"])
def test_an_index_without_a_weight_map_is_a_checkpoint_error(tiny, tmp_path, index):
    path, _ = _sharded(tmp_path, tiny)
    text = index if isinstance(index, str) else json.dumps(index)
    (path / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=INDEX_FILE):
        load_checkpoint(path)


def test_integer_tensors_are_refused_for_floating_point_parameters(tiny, tmp_path):
    def edit(tensors, config):
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.A_log"):
            tensors[name] = (tensors[name] * 1000).to(torch.int32)

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(_flat(tmp_path, tiny, edit))
    assert info.value.other == [
        "model.embed_tokens.weight: dtype int32, expected a floating-point tensor",
        "model.layers.0.self_attn.A_log: dtype int32, expected a floating-point tensor",
    ]


def test_an_unsupported_dtype_in_config_json_is_a_config_error(tiny, tmp_path):
    def edit(tensors, config):
        config["dtype"] = "float64"

    path = _flat(tmp_path, tiny, edit)
    with pytest.raises(ConfigError, match="config.json dtype 'float64' is not supported"):
        load_checkpoint(path)
    assert torch.equal(_logits(load_checkpoint(path, dtype="float32")), _logits(tiny))


def test_a_tensor_stored_in_two_shards_without_an_index_is_an_error(tiny, tmp_path):
    # Which copy loaded used to be an accident of the file names (the later one won).
    path, _ = _sharded(tmp_path, tiny)
    (path / INDEX_FILE).unlink()
    name = "language_model.model.embed_tokens.weight"
    save_file(
        {name: torch.zeros(tiny.config.vocab_size, tiny.config.hidden_size)},
        path / "zz-extra.safetensors",
    )
    for strict in (True, False):
        with pytest.raises(CheckpointError, match=f"{name}: in both .* and zz-extra"):
            load_checkpoint(path, strict=strict)


def test_two_spellings_of_one_tensor_are_an_error(tiny, tmp_path):
    # `language_model.model.norm.weight` and `model.norm.weight` are the same parameter; one of
    # them used to be dropped silently, even by a strict load.
    def edit(tensors, config):
        tensors["language_model.model.norm.weight"] = torch.zeros(tiny.config.hidden_size)

    path = _flat(tmp_path, tiny, edit)
    with pytest.raises(
        CheckpointError,
        match=r"language_model.model.norm.weight and model.norm.weight: both name "
        r"model.norm.weight",
    ):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.q_proj.weight",  # was cast silently, its scale unapplied
        "model.layers.1.block_sparse_moe.experts.0.w1.weight",  # stacking fp8 + fp32 raised
    ],
)
def test_fp8_weights_are_refused_not_read_without_their_scales(tiny, tmp_path, name):
    def edit(tensors, config):
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)

    with pytest.raises(CheckpointError) as info:
        load_checkpoint(_flat(tmp_path, tiny, edit), strict=False)
    assert info.value.other == [
        f"{name}: dtype float8_e4m3fn: FP8 weights need their scales, which the loader does "
        "not apply (bf16/fp16/fp32 weights and MXFP4 routed experts only)"
    ]


def test_a_dtype_given_only_inside_text_config_is_the_checkpoints(tiny, tmp_path):
    save_checkpoint(copy.deepcopy(tiny).to(torch.bfloat16), tmp_path, layout="k3")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dtype"]
    config["text_config"]["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_checkpoint(tmp_path)  # "auto": was float32, twice the memory
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_saving_in_an_unknown_layout_writes_nothing(tiny, tmp_path):
    with pytest.raises(ConfigError, match="layout must be 'k3' or 'kimi_linear'"):
        save_checkpoint(tiny, tmp_path / "out", layout="hf")
    assert not (tmp_path / "out").exists()


def test_mxfp4_experts_of_a_width_that_is_no_multiple_of_32_are_a_config_error(tmp_path):
    # Expected shapes floored cols / 32, so a checkpoint matching them passed the shape check
    # and building the experts then failed with a bare ValueError (a traceback in the CLI).
    cfg = get_preset("tiny")
    cfg = cfg.evolve(moe=attrs.evolve(cfg.moe, expert_intermediate_size=48))
    model = init_random_weights(KimiForCausalLM(cfg), seed=1)

    def edit(tensors, config):
        for name in [n for n in tensors if ".experts." in n and n.endswith(".weight")]:
            rows, cols = tensors.pop(name).shape
            tensors[name + "_packed"] = torch.zeros(rows, cols // 2, dtype=torch.uint8)
            tensors[name + "_scale"] = torch.full((rows, cols // 32), 127, dtype=torch.uint8)
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
        }

    with pytest.raises(ConfigError, match="multiples of 32; moe.expert_intermediate_size is 48"):
        load_checkpoint(_flat(tmp_path, model, edit))


@pytest.fixture(scope="module")
def tiny_tied():
    cfg = get_preset("tiny").evolve(tie_word_embeddings=True)
    return init_random_weights(KimiForCausalLM(cfg), seed=12).eval()


def test_a_tied_checkpoint_that_also_stores_an_equal_lm_head_loads_tied(
    tiny_tied, tmp_path, caplog
):
    """Exports often keep the redundant copy of a tied head; transformers loads such
    checkpoints, and so must strict loading (before, lm_head.weight was 'unexpected')."""

    def edit(tensors, config):
        assert "lm_head.weight" not in tensors  # our writer leaves the tied copy out
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    with caplog.at_level("WARNING", logger="tokenspeed"):
        model = load_checkpoint(_flat(tmp_path, tiny_tied, edit))
    assert not caplog.records  # redundant, not suspicious: loaded quietly
    assert model.config == tiny_tied.config and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(_logits(model), _logits(tiny_tied))


def test_a_stored_lm_head_that_is_no_copy_of_a_tied_embedding_is_used_as_transformers_does(
    tmp_path, caplog
):
    """transformers (5.x) does not tie weights that a checkpoint stores with different values
    (it warns and keeps both), and its KimiLinearForCausalLM never ties at all, so its
    `save_pretrained` with tie_word_embeddings=true writes a head that is not the embedding.
    Such a checkpoint loads untied, with the stored head, and the same logits as transformers."""
    from .hf_kimi_linear import save_tiny_kimi_linear

    hf = save_tiny_kimi_linear(tmp_path, seed=3, tie_word_embeddings=True)
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)
    with caplog.at_level("WARNING", logger="tokenspeed"):
        ours = load_checkpoint(tmp_path, dtype=torch.float32)
    assert "lm_head.weight differs from model.embed_tokens.weight" in caplog.text
    assert not ours.config.tie_word_embeddings  # the config describes the model as loaded
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight.detach())
    ids = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(1))
    logits = ours(ids, ForwardBatch.build([23]), ours.empty_state()).logits
    with torch.no_grad():
        expected = hf(input_ids=ids[None]).logits[0]
    assert (logits - expected).abs().max().item() <= 1e-4
    # Saved again, it is an untied checkpoint that round-trips as it is.
    again = load_checkpoint(save_checkpoint(ours, tmp_path / "again", layout="kimi_linear"))
    assert again.config == ours.config and torch.equal(again.lm_head.weight, ours.lm_head.weight)


def test_a_mis_shaped_lm_head_beside_a_tied_embedding_is_reported(tiny_tied, tmp_path):
    def edit(tensors, config):
        tensors["lm_head.weight"] = torch.zeros(3, 4)

    with pytest.raises(CheckpointError, match=r"lm_head.weight: shape \[3, 4\], expected"):
        load_checkpoint(_flat(tmp_path, tiny_tied, edit))


LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "intermediate_size": 128,
}


@pytest.mark.parametrize(
    ("changes", "found"),
    [
        ({}, "model_type 'llama'"),
        ({"model_type": None}, "architectures ['LlamaForCausalLM']"),
        ({"model_type": "deepseek_v3", "architectures": None}, "model_type 'deepseek_v3'"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused_naming_its_model_type(tmp_path, changes, found):
    raw = {k: v for k, v in (LLAMA | changes).items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_checkpoint(tmp_path)
    message = str(info.value)
    assert found in message and "kimi_linear" in message and "kimi_k3" in message
    assert "KimiLinearForCausalLM" in message and "num_heads" not in message


def test_a_checkpoints_footprint_counts_its_weights_in_the_loading_dtype_unread(tiny, tmp_path):
    from tokenspeed.model.loader import checkpoint_footprint

    save_checkpoint(tiny, tmp_path)
    for shard in tmp_path.glob("*.safetensors"):
        shard.write_bytes(b"")  # never read
    weights = [*tiny.parameters(), *tiny.buffers()]
    numel = sum(t.numel() for t in weights)
    half = checkpoint_footprint(tmp_path, "bfloat16")
    assert half.config == tiny.config and half.dtype == torch.bfloat16
    assert half.num_params == numel
    # Decay rates and the router stay fp32: a little more than 2 bytes a weight.
    assert 2 * numel < half.nbytes < 2.1 * numel
    auto = checkpoint_footprint(tmp_path)  # the checkpoint's own dtype
    assert auto.dtype == torch.float32
    assert auto.nbytes == sum(t.numel() * t.element_size() for t in weights)
