"""`ParallelConfig`: validated when built, naming the numbers; its layout; the model check."""

from __future__ import annotations

import math

import attrs
import pytest

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.model.init import init_random_weights
from tokenspeed.parallel import ParallelDims
from tokenspeed.runtime import EngineConfig
from tokenspeed.runtime.parallel_config import ParallelConfig, ParallelError, model_config_of


def test_defaults_and_layout():
    config = ParallelConfig(world_size=4)
    assert (config.tp, config.ep, config.expert_parallel) == (1, None, 4)
    assert config.timeout_s == 60.0
    assert config.dims() == ParallelDims(world_size=4, tp=1, ep=4)
    assert ParallelConfig(world_size=4, tp=2, ep=2).dims() == ParallelDims(world_size=4, tp=2, ep=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.world_size = 2
    with pytest.raises(TypeError):
        ParallelConfig(4)  # keyword only


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"world_size": 0}, "ParallelConfig.world_size must be an int >= 1, got 0"),
        ({"world_size": 2.0}, "ParallelConfig.world_size must be an int >= 1, got 2.0"),
        ({"world_size": True}, "ParallelConfig.world_size must be an int >= 1, got True"),
        ({"world_size": 2, "tp": 0}, "ParallelConfig.tp must be an int >= 1, got 0"),
        ({"world_size": 2, "ep": -2}, "ParallelConfig.ep must be an int >= 1, got -2"),
        ({"world_size": 4, "tp": 3}, "ParallelConfig.tp=3 does not divide world_size=4"),
        ({"world_size": 6, "ep": 4}, "ParallelConfig.ep=4 does not divide world_size=6"),
        ({"world_size": 2, "timeout_s": 0}, "timeout_s must be a positive number of seconds"),
        ({"world_size": 2, "timeout_s": math.inf}, "timeout_s must be a positive number"),
        ({"world_size": 2, "timeout_s": "60"}, "timeout_s must be a positive number"),
        ({"world_size": 2, "start_timeout_s": -1}, "start_timeout_s must be a positive"),
        ({"world_size": 2, "stop_grace_s": math.nan}, "stop_grace_s must be a positive"),
    ],
)
def test_bad_values_are_refused_naming_them(fields, message):
    with pytest.raises(ParallelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**fields)


def test_degrees_are_checked_against_the_model():
    tiny = get_preset("tiny")  # 16 routed experts, 4 KDA and MLA heads, hidden size 64
    ParallelConfig(world_size=4, tp=2).check_model(tiny)
    ParallelConfig(world_size=8, tp=4, ep=8).check_model(tiny)
    with pytest.raises(ParallelError, match=r"ep=3 does not divide the routed experts \(16\)"):
        ParallelConfig(world_size=3).check_model(tiny)
    with pytest.raises(ParallelError, match=r"tp=8 does not divide the KDA heads \(4\)"):
        ParallelConfig(world_size=8, tp=8).check_model(tiny)
    with pytest.raises(ParallelError, match=r"ep=32 does not divide the routed experts"):
        ParallelConfig(world_size=32).check_model(tiny)


def test_model_config_of_a_preset_and_a_checkpoint(tmp_path):
    assert model_config_of("tiny") == get_preset("tiny")
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=1)
    save_checkpoint(model, tmp_path, layout="k3", max_shard_bytes=1 << 20)
    config = model_config_of(tmp_path)
    assert config.moe.num_experts == 16 and config.kda.num_heads == 4
    with pytest.raises(ValueError, match="neither a preset"):
        model_config_of(tmp_path / "missing")


def test_dwdp_layout_and_l2_choice():
    config = ParallelConfig(world_size=4, dwdp=4)
    assert config.independent and config.expert_parallel == 1
    assert config.dims() == ParallelDims(world_size=4, dwdp=4)
    assert ParallelConfig(world_size=4, dwdp=2).dims().dwdp == 2
    assert ParallelConfig(world_size=4, dwdp=2, ep=1).expert_parallel == 1
    assert not ParallelConfig(world_size=2).independent
    assert (config.l2, config.l2_backend, config.starts_l2) == (None, "local", False)
    started = ParallelConfig(world_size=2, dwdp=2, l2="mooncake")
    assert (started.l2_backend, started.starts_l2) == ("mooncake", True)
    joined = ParallelConfig(world_size=2, l2_master="10.0.0.5:50051")  # DEP may share one too
    assert (joined.l2_backend, joined.starts_l2) == ("mooncake", False)
    ParallelConfig(world_size=2, l2="local").check_environment()  # nothing to check


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"world_size": 2, "dwdp": 2, "ep": 2}, "dwdp=2 runs every expert on every rank"),
        ({"world_size": 4, "dwdp": 2, "tp": 2}, "DWDP takes tp=1"),
        ({"world_size": 4, "dwdp": 3}, "ParallelConfig.dwdp=3 does not divide world_size=4"),
        ({"world_size": 2, "dwdp": 0}, "ParallelConfig.dwdp must be an int >= 1, got 0"),
        ({"world_size": 2, "l2": "shared"}, "l2 must be one of ['local', 'mooncake'] or None"),
        ({"world_size": 2, "l2_master": "nohost"}, "l2_master must be 'host:port', got 'nohost'"),
        ({"world_size": 2, "l2_master": "h:99999"}, "l2_master must be 'host:port'"),
        ({"world_size": 2, "l2": "local", "l2_master": "h:1"}, "l2='local' keeps a tier per"),
        ({"world_size": 2, "l2_segment_bytes": 1024}, "l2_segment_bytes must be an int of at"),
    ],
)
def test_bad_dwdp_and_l2_values_are_refused_naming_them(fields, message):
    pattern = message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    with pytest.raises(ParallelError, match=pattern.replace("]", r"\]")):
        ParallelConfig(**fields)


def test_dwdp_degree_is_checked_against_the_model():
    tiny = get_preset("tiny")  # 16 routed experts
    ParallelConfig(world_size=4, dwdp=4).check_model(tiny)
    with pytest.raises(ParallelError, match=r"dwdp=32 does not divide the routed experts \(16\)"):
        ParallelConfig(world_size=32, dwdp=32).check_model(tiny)


def test_unavailable_mooncake_is_refused_with_its_reason(monkeypatch):
    import tokenspeed.cache.l2.mooncake_services as services

    monkeypatch.setattr(services, "environment_ready", lambda: "mooncake unavailable: no wheel")
    with pytest.raises(ParallelError, match="cannot run here: mooncake unavailable: no wheel"):
        ParallelConfig(world_size=2, dwdp=2, l2="mooncake").check_environment()


def test_dcp_layout_groups_and_checks():
    config = ParallelConfig(world_size=4, dcp=2)
    assert config.dcp == 2 and config.attention_dp == 2 and config.expert_parallel == 4
    assert config.dims() == ParallelDims(world_size=4, ep=4, dcp=2)
    assert [config.dcp_ranks(r) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert ParallelConfig(world_size=2).dcp_ranks(1) == (1,)
    assert ParallelConfig(world_size=4, tp=2, dcp=2).dims().tp == 2
    tiny = get_preset("tiny")
    config.check_model(tiny)
    config.check_engine(EngineConfig(page_size=64))
    with pytest.raises(ParallelError, match="page_size=15 is not a multiple of 2"):
        config.check_engine(EngineConfig(page_size=15))
    no_mla = attrs.evolve(tiny, layer_kinds=("kda",) * 9)
    with pytest.raises(ParallelError, match="dcp=2 splits the MLA latent cache"):
        config.check_model(no_mla)
    ParallelConfig(world_size=4).check_model(no_mla)  # without DCP it has nothing to say
    with pytest.raises(ParallelError, match=r"ParallelConfig.dcp=3 does not divide world_size=4"):
        ParallelConfig(world_size=4, dcp=3)
    with pytest.raises(ParallelError, match="dwdp=2 ranks run independently"):
        ParallelConfig(world_size=2, dcp=2, dwdp=2)
    with pytest.raises(ParallelError, match="shared Mooncake tier evicts"):
        ParallelConfig(world_size=2, dcp=2, l2="mooncake")
