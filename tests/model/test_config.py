"""Configs: presets, the three config.json layouts, and errors that name the field."""

import json

import pytest

from tokenspeed.model import ConfigError, from_hf_config, get_preset, to_hf_config
from tokenspeed.model.config import (
    ActivationConfig,
    KdaConfig,
    MlaConfig,
    ModelConfig,
    MoeConfig,
)

from .hf_kimi_linear import hf_kimi_linear, tiny_hf_config


def _mla_positions(cfg):
    return [i + 1 for i in cfg.mla_layers]


def test_tiny_has_k3_structure_at_toy_width():
    cfg = get_preset("tiny")
    assert cfg.num_layers == 9 and _mla_positions(cfg) == [4, 8, 9]
    assert cfg.attn_res_block_size == 4
    assert cfg.moe.num_experts == 16 and cfg.moe.top_k == 4 and cfg.moe.num_shared_experts == 1
    assert cfg.moe.latent_size is not None and cfg.moe.latent_norm
    assert cfg.mlp_kinds[0] == "dense" and set(cfg.mlp_kinds[1:]) == {"moe"}
    assert cfg.kda.gate == "lower_bound" and cfg.kda.full_rank_output_gate
    assert cfg.mla.output_gate and cfg.mla.q_lora_rank
    assert cfg.activation.kind == "situ"
    assert get_preset("tiny", kda_gate="softplus").kda.gate == "softplus"


def test_real_presets_have_the_published_layer_plans():
    k3 = get_preset("kimi-k3")
    assert len(k3.kda_layers) == 69 and len(k3.mla_layers) == 24
    assert _mla_positions(k3) == [*range(4, 93, 4), 93]
    assert k3.mla.latent_width == 576 and k3.moe.latent_size == 3584
    kl = get_preset("kimi-linear-48b-a3b")
    assert len(kl.kda_layers) == 20 and _mla_positions(kl) == [4, 8, 12, 16, 20, 24, 27]
    assert kl.attn_res_block_size is None and kl.moe.routed_scaling_factor == 2.446


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        get_preset("nope")


K3_TEXT = {
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 12,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "first_k_dense_replace": 1,
    "hidden_act": "situ",
    "hidden_size": 7168,
    "intermediate_size": 33792,
    "kv_lora_rank": 512,
    "latent_moe_use_norm": True,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "model_type": "kimi_linear",
    "moe_intermediate_size": 3072,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 96,
    "num_expert_group": 1,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_hidden_layers": 93,
    "num_key_value_heads": 96,
    "num_shared_experts": 2,
    "pad_token_id": 163839,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-5,
    "routed_expert_hidden_size": 3584,
    "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_grouped_topk": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "linear_attn_config": {
        "full_attn_layers": [*range(4, 93, 4), 93],
        "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
        "gate_lower_bound": -5.0,
        "head_dim": 128,
        "num_heads": 96,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
    },
    "quantization_config": {"format": "mxfp4-pack-quantized", "quant_method": "compressed-tensors"},
}


def test_k3_layout_nests_the_text_model(tmp_path):
    raw = {"model_type": "kimi_k3", "text_config": K3_TEXT, "vision_config": {"patch_size": 14}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert from_hf_config(tmp_path) == get_preset("kimi-k3")
    assert from_hf_config(tmp_path / "config.json") == get_preset("kimi-k3")


KIMI_LINEAR_RELEASE = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "tie_word_embeddings": False,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
}


def test_original_kimi_linear_release_layout():
    assert from_hf_config(KIMI_LINEAR_RELEASE) == get_preset("kimi-linear-48b-a3b")


def test_transformers_native_layout_as_saved_by_save_pretrained(tmp_path):
    hf_kimi_linear()
    tiny_hf_config(n_group=4, topk_group=2).save_pretrained(tmp_path)
    cfg = from_hf_config(tmp_path)
    assert cfg.layer_kinds == ("kda", "kda", "kda", "mla", "kda", "mla")
    assert cfg.mlp_kinds == ("dense",) + ("moe",) * 5
    assert cfg.kda.num_heads == 4 and cfg.kda.head_dim == 16 and cfg.kda.gate == "softplus"
    assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2 and cfg.moe.num_shared_experts == 1
    assert cfg.moe.num_groups == 4 and cfg.moe.topk_groups == 2
    assert cfg.eos_token_ids == (2,)


@pytest.mark.parametrize("name", ["tiny", "kimi-k3", "kimi-linear-48b-a3b"])
@pytest.mark.parametrize("layout", ["k3", "kimi_linear"])
def test_to_hf_config_round_trips(name, layout):
    cfg = get_preset(name)
    assert from_hf_config(to_hf_config(cfg, layout=layout)) == cfg


def _k3_situ(**changes):
    """K3's config.json with some SiTU keys changed; a value of ... drops the key."""
    text = dict(K3_TEXT)
    for key, value in changes.items():
        if value is ...:
            del text[key]
        else:
            text[key] = value
    return {"model_type": "kimi_k3", "text_config": text}


@pytest.mark.parametrize(
    "changes,beta,linear_beta",
    [
        ({}, 4.0, 25.0),  # as K3 ships: both set
        # K3's modeling code takes both with getattr(config, key, None) and runs
        # SituAndMul(beta or 1.0, linear_beta): an absent (or null) linear beta leaves `up`
        # uncapped, and an absent (or null) beta is 1, whatever K3's own config.json sets.
        ({"activation_situ_linear_beta": ...}, 4.0, None),
        ({"activation_situ_linear_beta": None}, 4.0, None),
        ({"activation_situ_beta": ...}, 1.0, 25.0),
        ({"activation_situ_beta": None}, 1.0, 25.0),
    ],
)
def test_situ_betas_a_config_omits_read_as_k3s_modeling_code_reads_them(changes, beta, linear_beta):
    act = from_hf_config(_k3_situ(**changes)).activation
    assert act == ActivationConfig(kind="situ", situ_beta=beta, situ_linear_beta=linear_beta)


@pytest.mark.parametrize("linear_beta", [25.0, None, 7.5])
@pytest.mark.parametrize("beta", [4.0, 1.0, 2.5])
@pytest.mark.parametrize("layout", ["k3", "kimi_linear"])
def test_situ_betas_round_trip_through_config_json(tmp_path, layout, beta, linear_beta):
    cfg = get_preset("tiny").evolve(
        activation=ActivationConfig(kind="situ", situ_beta=beta, situ_linear_beta=linear_beta)
    )
    hf = to_hf_config(cfg, layout=layout)
    text = hf["text_config"] if layout == "k3" else hf
    # Both written, an uncapped `up` as an explicit null: any reader, ours or the reference's,
    # gets the values meant rather than its defaults for absent keys.
    assert text["activation_situ_beta"] == beta
    assert "activation_situ_linear_beta" in text
    assert text["activation_situ_linear_beta"] == linear_beta
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert from_hf_config(tmp_path).activation == cfg.activation


def _broken(path, value):
    raw = json.loads(json.dumps(KIMI_LINEAR_RELEASE))
    node = raw
    *parents, leaf = path
    for key in parents:
        node = node[key]
    if value is None:
        del node[leaf]
    else:
        node[leaf] = value
    return raw


@pytest.mark.parametrize(
    "path,value,message",
    [
        (("kv_lora_rank",), None, "lacks kv_lora_rank"),
        (("linear_attn_config", "kda_layers"), [1, 2, 3, 4], "assigns layer 4 more than once"),
        (("linear_attn_config", "full_attn_layers"), [4, 8], "in neither"),
        (("linear_attn_config", "full_attn_layers"), [4, 8, 12, 16, 20, 24, 28], "outside 1..27"),
        (("num_key_value_heads",), 8, "num_key_value_heads"),
        (("hidden_act",), "gelu", "hidden_act 'gelu'"),
        (("moe_router_activation_func",), "softmax", "sigmoid only"),
        (("num_experts_per_token",), 300, "MoeConfig.top_k|moe.top_k"),
        (("hidden_size",), -5, "ModelConfig.hidden_size must be a positive integer"),
        (("linear_attn_config", "num_heads"), 0, "KdaConfig.num_heads"),
        (("mla_use_nope",), False, "mla_use_nope"),
        (("eos_token_id",), 999999, "eos_token_ids entry 999999 is outside the vocabulary"),
    ],
)
def test_inconsistent_configs_name_the_problem(path, value, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_config(_broken(path, value))


@pytest.mark.parametrize(
    "path,value",
    [
        (("linear_attn_config", "kda_layers"), "1"),  # a string where a list of layers goes
        (("linear_attn_config",), [1, 2]),
        (("eos_token_id",), {"id": 2}),
    ],
)
def test_values_of_the_wrong_kind_are_config_errors(path, value):
    with pytest.raises(ConfigError, match="wrong type or form"):
        from_hf_config(_broken(path, value))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\udcff"])
def test_a_config_json_that_is_not_a_json_object_is_a_config_error(tmp_path, text):
    (tmp_path / "config.json").write_bytes(text.encode(errors="surrogateescape"))
    with pytest.raises(ConfigError, match="config.json"):
        from_hf_config(tmp_path)


def test_direct_construction_validates_with_field_names():
    with pytest.raises(ConfigError, match="KdaConfig.gate must be one of"):
        KdaConfig(num_heads=2, head_dim=4, gate="sigmoid")
    with pytest.raises(ConfigError, match="moe.num_groups .* must divide"):
        MoeConfig(num_experts=10, top_k=2, expert_intermediate_size=4, num_groups=4)
    with pytest.raises(ConfigError, match="moe.latent_norm needs moe.latent_size"):
        MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=4, latent_norm=True)
    with pytest.raises(ConfigError, match="layer_kinds has 2 entries but mlp_kinds has 3"):
        ModelConfig(
            vocab_size=10,
            hidden_size=4,
            layer_kinds=("kda", "mla"),
            mlp_kinds=("dense", "dense", "dense"),
            dense_intermediate_size=8,
            kda=KdaConfig(num_heads=1, head_dim=4),
            mla=MlaConfig(
                num_heads=1, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2
            ),
        )
    with pytest.raises(ConfigError, match="mlp_kinds names 'moe' layers but moe is None"):
        get_preset("tiny").evolve(moe=None)


def test_configs_are_frozen():
    cfg = get_preset("tiny")
    with pytest.raises(AttributeError):
        cfg.hidden_size = 3


@pytest.mark.parametrize(
    "path,value,message",
    [
        # i % 0 raised ZeroDivisionError, a traceback instead of an error naming the field
        (("moe_layer_freq",), 0, "moe_layer_freq must be a positive integer, got 0"),
        (("moe_layer_freq",), -2, "moe_layer_freq must be a positive integer, got -2"),
        (("first_k_dense_replace",), -1, "first_k_dense_replace must be a non-negative"),
        (("num_hidden_layers",), 0, "num_hidden_layers must be a positive integer, got 0"),
        # NaN and inf passed `value <= 0`; a zero linear beta divides by zero in SiTU
        (("routed_scaling_factor",), float("nan"), "routed_scaling_factor must be a finite"),
        (("rms_norm_eps",), float("inf"), "rms_norm_eps must be a finite positive number"),
        (("activation_situ_linear_beta",), 0, "situ_linear_beta must be a finite positive"),
        (("linear_attn_config", "gate_lower_bound"), float("-inf"), "negative and finite"),
    ],
)
def test_layer_plans_and_numbers_that_make_no_model_are_refused(path, value, message):
    raw = _broken(path, value)
    if path == ("activation_situ_linear_beta",):
        raw["hidden_act"] = "situ"
    with pytest.raises(ConfigError, match=message):
        from_hf_config(raw)


@pytest.mark.parametrize(
    "path,value,message",
    [
        # bool("false") is True: these turned a part on, or read a switch as a number
        (("tie_word_embeddings",), "false", "tie_word_embeddings must be true or false"),
        (("mla_use_output_gate",), "no", "mla_use_output_gate must be true or false"),
        (("linear_attn_config", "use_full_rank_gate"), "false", "use_full_rank_gate must be"),
        (("moe_renormalize",), "false", "moe_renormalize / norm_topk_prob must be true"),
        (("rms_norm_eps",), True, "rms_norm_eps must be a number, got True"),
        (("routed_scaling_factor",), "2.446", "routed_scaling_factor must be a number"),
        # int() read 2.7 as token 2 and "5" as token 5
        (("eos_token_id",), [2.7], "eos_token_id must be an integer or a list of integers"),
        (("eos_token_id",), "5", "eos_token_id must be an integer or a list of integers"),
        # True passed `1 <= True <= 27` as layer 1
        (("linear_attn_config", "kda_layers"), [True, 2, 3], "linear_attn_config.kda_layers must"),
    ],
)
def test_switches_and_numbers_of_the_wrong_kind_name_their_field(path, value, message):
    with pytest.raises(ConfigError, match=f"wrong type or form: {message}"):
        from_hf_config(_broken(path, value))


def test_switches_written_as_0_or_1_still_read():
    cfg = from_hf_config(_broken(("tie_word_embeddings",), 1))
    assert cfg.tie_word_embeddings is True
    assert from_hf_config(_broken(("moe_renormalize",), 0)).moe.renormalize is False


def test_layer_types_and_linear_attn_config_lists_must_agree():
    listed = get_preset("kimi-linear-48b-a3b").layer_kinds
    names = {"kda": "linear_attention", "mla": "full_attention"}
    agreeing = [names[k] for k in listed]
    raw = _broken(("layer_types",), agreeing)
    assert from_hf_config(raw) == get_preset("kimi-linear-48b-a3b")
    shifted = agreeing[1:] + agreeing[:1]  # MLA at 3, 7, ... instead of 4, 8, ...
    with pytest.raises(ConfigError, match=r"disagree about 1-based layers \[3, 4, 7, 8"):
        from_hf_config(_broken(("layer_types",), shifted))


def _mla():
    return MlaConfig(
        num_heads=1, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2
    )


@pytest.mark.parametrize(
    "build,message",
    [
        (
            lambda: MoeConfig(
                num_experts=8, top_k=2, expert_intermediate_size=4, num_shared_experts=1.5
            ),
            "MoeConfig.num_shared_experts must be a non-negative integer, got 1.5",
        ),
        (
            lambda: MoeConfig(
                num_experts=8, top_k=2, expert_intermediate_size=4, num_shared_experts=True
            ),
            "MoeConfig.num_shared_experts must be a non-negative integer, got True",
        ),
        (
            lambda: MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=4, renormalize=0),
            "MoeConfig.renormalize must be True or False, got 0",
        ),
        (
            lambda: MoeConfig(
                num_experts=8,
                top_k=2,
                expert_intermediate_size=4,
                routed_scaling_factor=float("inf"),
            ),
            "MoeConfig.routed_scaling_factor must be a finite positive number",
        ),
        (
            lambda: KdaConfig(num_heads=2, head_dim=4, full_rank_output_gate=1),
            "KdaConfig.full_rank_output_gate must be True or False, got 1",
        ),
        (
            lambda: KdaConfig(num_heads=2, head_dim=4, gate="lower_bound", gate_lower_bound="-5"),
            "kda.gate_lower_bound must be a number",
        ),
        (
            lambda: MlaConfig(
                num_heads=1,
                kv_lora_rank=4,
                qk_nope_head_dim=2,
                qk_rope_head_dim=2,
                v_head_dim=2,
                output_gate="yes",
            ),
            "MlaConfig.output_gate must be True or False",
        ),
        (
            lambda: ActivationConfig(kind="situ", situ_linear_beta=0),
            "ActivationConfig.situ_linear_beta must be a finite positive number, got 0",
        ),
        (
            lambda: get_preset("tiny").evolve(bos_token_id=True),
            "ModelConfig.bos_token_id must be an integer, got True",
        ),
        (
            lambda: get_preset("tiny").evolve(pad_token_id=1.5),
            "ModelConfig.pad_token_id must be an integer, got 1.5",
        ),
        (
            lambda: get_preset("tiny").evolve(eos_token_ids=(2.5,)),
            "ModelConfig.eos_token_ids must hold integers",
        ),
        (
            lambda: get_preset("tiny").evolve(tie_word_embeddings=1),
            "ModelConfig.tie_word_embeddings must be True or False",
        ),
    ],
)
def test_direct_construction_refuses_values_of_the_wrong_kind(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_preset_option_it_does_not_take_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'kimi-k3' takes options \[\], got \['kda_gate'\]"):
        get_preset("kimi-k3", kda_gate="softplus")
    with pytest.raises(ConfigError, match=r"preset 'tiny' takes options \['kda_gate'\]"):
        get_preset("tiny", gate="softplus")
