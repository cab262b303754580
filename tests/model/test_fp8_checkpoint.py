"""FP8 block-scaled checkpoints (DeepSeek / Kimi FP8 releases): e4m3 weights with
`weight_scale_inv` fp32 [ceil(out/B0), ceil(in/B1)] beside them.

Measured on CPU (tiny presets, bf16):
- FP8 model vs the same weights dequantised into a bf16 checkpoint: identical logits and greedy
  tokens (the CPU forward dequantises and multiplies as an nn.Linear of the dequantised weight
  does); asserted exactly.
- FP8 model vs the original bf16 model, on a dense-MLP variant of tiny whose output projections
  are scaled by 0.3 (MoE routing flips make a random MoE model's logits jump: tiny's bf16 and
  fp32 logits differ by 55% relative there): relative logit error 0.041 at 128 x 128 blocks
  (bf16 vs fp32 of the same model: 0.011), top-1 agreement 97%; asserted < 0.08 and >= 90%.
- One linear: FP8 vs bf16 weights, relative output error ~0.026; asserted < 0.05.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenspeed import LLM, SamplingParams
from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.config import ConfigError
from tokenspeed.model.fp8_writer import quantize_checkpoint
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.fp8_linear import (
    Fp8Linear,
    dequantize_fp8_blockwise,
    dequantize_fp8_linears,
    quantize_fp8_blockwise,
)
from tokenspeed.model.loader import (
    INDEX_FILE,
    CheckpointError,
    checkpoint_footprint,
    load_checkpoint,
)
from tokenspeed.model.partial_loader import load_checkpoint_into

FP8 = torch.float8_e4m3fn


def _model(config=None, seed=11, damp=1.0):
    model = init_random_weights(KimiForCausalLM(config or get_preset("tiny")), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")):
                p.mul_(damp)
    return model.eval()


def _bf16_checkpoint(model, path):
    """`model` saved in fp32, reloaded in bf16 and saved again: a bf16 checkpoint and its model
    (decay rates and router in fp32, as the loader keeps them)."""
    save_checkpoint(model, path / "fp32")
    bf16 = load_checkpoint(path / "fp32", dtype="bfloat16")
    save_checkpoint(bf16, path / "bf16")
    shutil.rmtree(path / "fp32")
    return bf16, path / "bf16"


def _logits(model, n=48, seed=0):
    ids = torch.randint(
        0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    )
    return model(ids, ForwardBatch.build([n]), model.empty_state()).logits.float()


def _read(path):
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors, json.loads((path / "config.json").read_text())


def _write(path, tensors, config):
    """A single-shard checkpoint (no index: the loader lists the shard's tensors)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def _dequantised_checkpoint(src, dst):
    """The FP8 checkpoint at `src` with every FP8 weight dequantised (independently of the
    library: the scales expanded by a Kronecker product) into bf16, without its
    quantization_config: the model an FP8 model must reproduce."""
    tensors, config = _read(src)
    block = config.pop("quantization_config")["weight_block_size"]
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        if scale is not None:
            full = torch.kron(scale, torch.ones(block))[: t.shape[0], : t.shape[1]]
            t = (t.float() * full).to(torch.bfloat16)
        out[name] = t
    return _write(dst, out, config)


def _key(tensors, suffix):
    (name,) = [n for n in tensors if n.endswith(suffix)]
    return name


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """(bf16 model, its checkpoint) of the tiny preset (KDA, MLA with q LoRA and output gate,
    latent MoE with shared experts, AttnRes)."""
    return _bf16_checkpoint(_model(), tmp_path_factory.mktemp("bf16"))


@pytest.fixture(scope="module")
def fp8_dir(bf16, tmp_path_factory):
    return quantize_checkpoint(bf16[1], tmp_path_factory.mktemp("fp8"))


# --- The module ---------------------------------------------------------------------------------


def test_block_quantisation_is_the_expert_helpers_and_cuts_ragged_edges():
    from tokenspeed.model.ops.moe.fp8 import quantize_fp8_blocks

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_blockwise(w)
    q_ref, s_ref = quantize_fp8_blocks(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    # Edges: 70 x 50 in 32 x 16 blocks -> 3 x 4 scales, each its block's amax / 448.
    w = torch.randn(70, 50, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp8_blockwise(w, (32, 16))
    assert q.dtype == FP8 and q.shape == (70, 50) and s.shape == (3, 4)
    assert torch.allclose(s[2, 3], w[64:, 48:].abs().max() / 448)
    back = dequantize_fp8_blockwise(q, s, (32, 16))
    assert (back - w).norm() / w.norm() < 0.04


def test_fp8_linear_forward_on_cpu_is_the_dequantised_linear():
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=False)
    fp8 = Fp8Linear.from_linear(linear, (64, 32))
    assert fp8.weight.dtype == FP8 and fp8.weight_scale_inv.shape == (4, 3)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    expected = nn.functional.linear(x, fp8.dequantized_weight().to(torch.bfloat16))
    assert torch.equal(fp8(x), expected)
    assert torch.equal(fp8(x[None])[0], expected)  # leading dims
    ref = linear.to(torch.bfloat16)(x).float()
    assert (fp8(x).float() - ref).norm() / ref.norm() < 0.05
    # A dtype cast moves nothing out of FP8 and keeps the scales fp32.
    fp8.to(torch.bfloat16)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale_inv.dtype == torch.float32
    assert torch.equal(fp8(x), expected)
    assert "block_size=[64, 32]" in repr(fp8)


# --- Loading ------------------------------------------------------------------------------------


def test_fp8_checkpoint_keeps_the_projections_in_fp8(bf16, fp8_dir):
    del bf16  # the fp8 checkpoint is written from it
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    stored = json.loads((fp8_dir / INDEX_FILE).read_text())["weight_map"]
    assert "language_model.model.layers.0.self_attn.q_proj.weight_scale_inv" in stored
    model = load_checkpoint(fp8_dir)
    layers = model.model.layers
    kda, mla, dense, moe = layers[0].self_attn, layers[3].self_attn, layers[0].mlp, layers[1].mlp
    fp8_modules = [
        *(getattr(kda, n) for n in ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "b_proj")),
        *(getattr(mla, n) for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")),
        dense.gate_proj,
        dense.down_proj,
        moe.shared_experts.up_proj,
        moe.routed_expert_down_proj,
    ]
    for module in fp8_modules:
        assert isinstance(module, Fp8Linear), module
        assert module.weight.dtype == FP8 and module.weight_scale_inv.dtype == torch.float32
    # kv_b_proj is read only through its weight (absorbed): dequantised at load, like experts.
    assert isinstance(mla.kv_b_proj, nn.Linear) and mla.kv_b_proj.weight.dtype == torch.bfloat16
    assert moe.experts.w1.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == torch.float32


@pytest.mark.parametrize(
    "block, experts", [((128, 128), False), ((32, 16), True)], ids=["128x128", "32x16-experts"]
)
def test_logits_are_the_dequantised_models(bf16, tmp_path, block, experts):
    """Exactly (CPU): the FP8 model computes what the dequantised bf16 model computes. 32 x 16
    blocks give ragged edge blocks (b_proj has 4 rows, f_a_proj 16) and several blocks per
    weight; routed experts stored FP8 are dequantised at load."""
    fp8_dir = quantize_checkpoint(bf16[1], tmp_path / "fp8", block_size=block, experts=experts)
    reference = load_checkpoint(_dequantised_checkpoint(fp8_dir, tmp_path / "deq"))
    model = load_checkpoint(fp8_dir)
    assert model.model.layers[0].self_attn.b_proj.weight_scale_inv.shape == (
        -(-4 // block[0]),
        -(-64 // block[1]),
    )
    assert torch.equal(_logits(model), _logits(reference))
    # And the library's own dequantisation of the loaded model gives that reference too.
    assert torch.equal(_logits(dequantize_fp8_linears(model)), _logits(reference))


def test_routed_experts_mixing_fp8_and_bf16_load_dequantised(bf16, tmp_path):
    """A stack of experts some of which are stored FP8 (dequantised) and some not."""
    fp8_dir = quantize_checkpoint(bf16[1], tmp_path / "fp8", block_size=(16, 16), experts=True)
    tensors, config = _read(fp8_dir)
    original, _ = _read(bf16[1])
    name = _key(tensors, "layers.1.block_sparse_moe.experts.3.w2.weight")
    tensors[name] = original[name]
    del tensors[name + "_scale_inv"]
    mixed = _write(tmp_path / "mixed", tensors, config)
    reference = load_checkpoint(_dequantised_checkpoint(mixed, tmp_path / "deq"))
    model = load_checkpoint(mixed)
    w2 = model.model.layers[1].mlp.experts.w2
    assert w2.dtype == torch.bfloat16 and torch.equal(w2[3], original[name])
    assert torch.equal(w2, reference.model.layers[1].mlp.experts.w2)
    assert torch.equal(_logits(model), _logits(reference))


def test_logits_stay_close_to_the_bf16_original(tmp_path):
    """Dense MLPs (no routing flips) and damped output projections (the residual stream
    dominates, as in trained models): FP8 adds a few percent of relative logit error."""
    tiny = get_preset("tiny")
    config = tiny.evolve(attn_res_block_size=None, mlp_kinds=("dense",) * tiny.num_layers, moe=None)
    original, bf16_dir = _bf16_checkpoint(_model(config, damp=0.3), tmp_path)
    model = load_checkpoint(quantize_checkpoint(bf16_dir, tmp_path / "fp8"))
    ref, got = _logits(original, n=64), _logits(model, n=64)
    rel = ((got - ref).norm() / ref.norm()).item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"FP8 vs bf16 original: relative logit error {rel:.4f}, top-1 agreement {top1:.3f}")
    assert rel < 0.08, rel  # measured 0.041
    assert top1 >= 0.9, top1  # measured 0.97


def test_greedy_tokens_through_llm_are_the_dequantised_models(fp8_dir, tmp_path):
    deq_dir = _dequantised_checkpoint(fp8_dir, tmp_path / "deq")
    prompts = [
        {"prompt_token_ids": [5, 6, 7, 8]},
        {"prompt_token_ids": list(range(40, 90))},
        {"prompt_token_ids": [300, 2, 17]},
    ]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for name, path in (("fp8", fp8_dir), ("deq", deq_dir)):
        llm = LLM(str(path), device="cpu", max_num_seqs=4)
        try:
            if name == "fp8":
                assert isinstance(llm.engine.model.model.layers[0].self_attn.q_proj, Fp8Linear)
            outs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    assert outs["fp8"] == outs["deq"]
    assert all(len(t) == 10 for t in outs["fp8"])


@pytest.mark.parametrize("key", ["ignored_layers", "modules_to_not_convert"])
def test_ignored_layers_stay_in_bf16(bf16, tmp_path, key):
    original, bf16_dir = bf16
    ignored = ["model.layers.0.mlp", "self_attn.o_proj", "language_model.model.layers.3"]
    fp8_dir = quantize_checkpoint(bf16_dir, tmp_path / "fp8", ignored=ignored, ignored_key=key)
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"][key] == ignored
    model = load_checkpoint(fp8_dir)
    layers, before = model.model.layers, original.model.layers
    kept = [
        (layers[0].mlp.down_proj, before[0].mlp.down_proj),
        (layers[1].self_attn.o_proj, before[1].self_attn.o_proj),
        (layers[3].self_attn.q_a_proj, before[3].self_attn.q_a_proj),
        (layers[3].mlp.shared_experts.up_proj, before[3].mlp.shared_experts.up_proj),
    ]
    for got, want in kept:
        assert type(got) is nn.Linear and torch.equal(got.weight, want.weight)
    assert isinstance(layers[1].self_attn.q_proj, Fp8Linear)
    assert isinstance(layers[4].mlp.shared_experts.up_proj, Fp8Linear)
    reference = load_checkpoint(_dequantised_checkpoint(fp8_dir, tmp_path / "deq"))
    assert torch.equal(_logits(model), _logits(reference))
    # The footprint from config.json alone counts the ignored modules in bf16 too.
    assert checkpoint_footprint(fp8_dir).nbytes == _bytes(model)


def _bytes(module):
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_fp8_projections_take_half_the_bytes(bf16, fp8_dir):
    original, _ = bf16
    model = load_checkpoint(fp8_dir)
    fp8_names = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert len(fp8_names) > 80
    fp8_bytes = sum(_bytes(model.get_submodule(n)) for n in fp8_names)
    bf16_bytes = sum(_bytes(original.get_submodule(n)) for n in fp8_names)
    # One byte a weight plus one fp32 scale per 128 x 128 block (one per tiny weight).
    assert 0.5 <= fp8_bytes / bf16_bytes < 0.52, fp8_bytes / bf16_bytes
    # Nothing else changed size (tiny's bytes are mostly routed experts and embeddings).
    assert _bytes(original) - _bytes(model) == bf16_bytes - fp8_bytes
    # The memory check before loading counts what the load then holds.
    assert checkpoint_footprint(fp8_dir).nbytes == _bytes(model)


# --- Malformed checkpoints ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        ({"weight_block_size": [128]}, r"weight_block_size must be two positive ints.*\[128\]"),
        ({"weight_block_size": [0, 128]}, "weight_block_size must be two positive ints"),
        ({"weight_block_size": [128, "128"]}, "weight_block_size must be two positive ints"),
        ({"weight_block_size": [True, 128]}, "weight_block_size must be two positive ints"),
        ({"weight_block_size": None}, "no weight_block_size; per-tensor FP8 scales"),
        ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
        ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
        ({"ignored_layers": "lm_head"}, "ignored_layers must be a list of module names"),
    ],
)
def test_malformed_quantization_configs_are_refused(fp8_dir, tmp_path, change, match):
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"].update(change)
    shutil.copytree(fp8_dir, tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        load_checkpoint(tmp_path / "bad")
    with pytest.raises(ConfigError, match=match):
        checkpoint_footprint(tmp_path / "bad")


def test_other_quant_methods_are_refused(fp8_dir, tmp_path):
    tensors, config = _read(fp8_dir)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(CheckpointError, match=r"quantized checkpoints \(awq\) are not supported"):
        load_checkpoint(_write(tmp_path / "awq", tensors, config))


def _broken(fp8_dir, tmp_path, edit):
    tensors, config = _read(fp8_dir)
    edit(tensors, config)
    return _write(tmp_path / "broken", tensors, config)


def _set(tensors, suffix, value):
    tensors[_key(tensors, suffix)] = value


def _wrong_scale_shape(t, c):
    _set(t, "layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(1, 2))


def _missing_scale(t, c):
    del t[_key(t, "layers.2.block_sparse_moe.shared_experts.down_proj.weight_scale_inv")]


def _no_quant_config(t, c):
    del c["quantization_config"]


def _other_block_size(t, c):
    c["quantization_config"]["weight_block_size"] = [32, 32]


def _ignored_but_fp8(t, c):
    c["quantization_config"]["ignored_layers"] = ["model.layers.0.self_attn.o_proj"]


def _scale_beside_bf16(t, c):
    name = _key(t, "layers.0.self_attn.o_proj.weight")
    t[name] = torch.zeros(t[name].shape, dtype=torch.bfloat16)


def _scale_of_a_norm(t, c):
    t[_key(t, "model.norm.weight") + "_scale_inv"] = torch.ones(1, 1)


def _e5m2(t, c):
    name = _key(t, "layers.0.self_attn.k_proj.weight")
    t[name] = t[name].float().to(torch.float8_e5m2)


def _fp8_norm(t, c):
    name = _key(t, "layers.0.input_layernorm.weight")
    t[name] = t[name].float().to(FP8)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            _wrong_scale_shape,
            r"(?s)mis-shaped.*layers\.0\.self_attn\.q_proj\.weight_scale_inv: shape \[1, 2\], "
            r"expected \[1, 1\] \(one scale per block .* weight_block_size \[128, 128\]\)",
        ),
        (
            _missing_scale,
            r"layers\.2\.block_sparse_moe\.shared_experts\.down_proj\.weight: dtype "
            r"float8_e4m3fn without its block scales .*down_proj\.weight_scale_inv",
        ),
        (_no_quant_config, r"weight_scale_inv: FP8 block scales, but config\.json has no"),
        (_other_block_size, r"q_proj\.weight_scale_inv: shape \[1, 1\], expected \[2, 2\]"),
        (_ignored_but_fp8, r"o_proj\.weight: stored in FP8, but .* lists its module in ignored"),
        (_scale_beside_bf16, r"o_proj\.weight: dtype bfloat16 with block scales .* beside it"),
        (_scale_of_a_norm, r"model\.norm\.weight_scale_inv: FP8 block scales are read for the"),
        (_e5m2, r"k_proj\.weight: dtype float8_e5m2; FP8 weights must be float8_e4m3fn"),
        (_fp8_norm, r"input_layernorm\.weight: dtype float8_e4m3fn; only the decoder layers'"),
    ],
    ids=lambda v: getattr(v, "__name__", "")[1:] or None,
)
def test_malformed_fp8_tensors_are_refused_by_name(fp8_dir, tmp_path, edit, match):
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(_broken(fp8_dir, tmp_path, edit))


def test_every_problem_is_reported_together(fp8_dir, tmp_path):
    def edit(t, c):
        _missing_scale(t, c)
        _e5m2(t, c)
        _scale_beside_bf16(t, c)

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(_broken(fp8_dir, tmp_path, edit))
    assert len(err.value.other) == 3, err.value


def test_the_sliced_loader_refuses_fp8_checkpoints(fp8_dir):
    with torch.device("meta"):
        model = KimiForCausalLM(get_preset("tiny"))
    with pytest.raises(CheckpointError, match="FP8 block-scaled checkpoint.*only load_checkpoint"):
        load_checkpoint_into(model, fp8_dir, config=model.config)
