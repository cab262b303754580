"""Limits checked before the work starts: max_model_len against the model's own limit, and the
weights against the device's free memory."""

import time

import pytest
import torch

from tokenspeed import LLM
from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.model.init import init_random_weights
from tokenspeed.runtime import Engine, EngineConfig, EngineConfigError, device, llm
from tokenspeed.runtime.device import InsufficientMemoryError
from tokenspeed.runtime.llm import load_model

GIB = 1 << 30


@pytest.fixture(scope="module")
def short():
    """The tiny preset with a checkpoint's limit of 512 positions."""
    config = get_preset("tiny").evolve(max_position_embeddings=512)
    return init_random_weights(KimiForCausalLM(config), seed=3).eval()


@pytest.fixture(scope="module")
def short_dir(short, tmp_path_factory):
    return save_checkpoint(short, tmp_path_factory.mktemp("short"))


def test_max_model_len_defaults_to_the_models_limit(short, tiny):
    assert EngineConfig().max_model_len is None  # resolved against the model
    engine = Engine(short, None, EngineConfig(device="cpu", max_num_seqs=2))
    assert engine.config.max_model_len == 512
    assert engine.config.max_pages_per_request == 8
    # A limit past DEFAULT_MAX_MODEL_LEN (the presets': a million positions) keeps 8192, whose
    # default cache fits where the engine runs.
    assert tiny.config.max_position_embeddings > 8192
    engine = Engine(tiny, None, EngineConfig(device="cpu", max_num_seqs=2))
    assert engine.config.max_model_len == 8192


def test_max_model_len_above_the_models_limit_is_refused_naming_both(short):
    with pytest.raises(EngineConfigError, match=r"max_model_len=1024.*512"):
        Engine(short, None, EngineConfig(device="cpu", max_num_seqs=2, max_model_len=1024))
    # Up to the limit is fine.
    Engine(short, None, EngineConfig(device="cpu", max_num_seqs=2, max_model_len=512))


def test_an_unresolved_max_model_len_has_no_page_count():
    with pytest.raises(EngineConfigError, match="max_model_len"):
        EngineConfig().max_pages_per_request  # noqa: B018


def test_llm_over_a_checkpoint_takes_its_limit(short_dir):
    model = LLM(str(short_dir), device="cpu", max_num_seqs=2)
    assert model.engine.config.max_model_len == 512
    with pytest.raises(EngineConfigError, match=r"max_model_len=600.*512"):
        LLM(str(short_dir), device="cpu", max_num_seqs=2, max_model_len=600)


def _free(monkeypatch, nbytes):
    monkeypatch.setattr(device, "free_memory_bytes", lambda where: nbytes)


def test_the_48b_preset_is_refused_at_once_where_it_cannot_fit(monkeypatch):
    _free(monkeypatch, 23 * GIB)
    start = time.perf_counter()
    with pytest.raises(InsufficientMemoryError) as info:
        load_model("kimi-linear-48b-a3b", device="cpu")
    assert time.perf_counter() - start < 2
    message = str(info.value)
    assert "preset 'kimi-linear-48b-a3b' has 49.1B parameters" in message
    assert "183.0 GiB in float32" in message and "cpu device has 23.0 GiB free" in message
    assert "presets that fit: tiny" in message
    net, _ = load_model("tiny", device="cpu")  # which loads
    assert net.lm_head.weight.dtype == torch.float32


def test_on_this_machine_the_48b_preset_is_refused_fast():
    # This machine's real free memory: the dev and CI machines have tens of GiB.
    if (device.free_memory_bytes(torch.device("cpu")) or 0) > 150 * GIB:
        pytest.skip("this machine could make the 48B preset's 183 GiB of weights")
    start = time.perf_counter()
    with pytest.raises(InsufficientMemoryError, match="GiB free"):
        LLM("kimi-linear-48b-a3b", device="cpu")
    assert time.perf_counter() - start < 3


def test_a_preset_is_made_in_float32_on_the_host_whatever_its_dtype(monkeypatch):
    # 48B in bf16 is 91.5 GiB, but its random weights are made in fp32 (183 GiB) first.
    _free(monkeypatch, 100 * GIB)
    with pytest.raises(InsufficientMemoryError, match="183.0 GiB in float32.*made on the host"):
        load_model("kimi-linear-48b-a3b", dtype="bfloat16", device="cpu")


def test_a_checkpoint_too_large_for_the_memory_is_refused_before_reading_it(
    short, short_dir, monkeypatch
):
    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(llm, "load_checkpoint", refuse)
    params = sum(t.numel() for t in [*short.parameters(), *short.buffers()])
    fp32 = params * 4
    _free(monkeypatch, fp32 * 3 // 4)  # room for bf16, not for fp32
    with pytest.raises(InsufficientMemoryError) as info:
        load_model(str(short_dir), device="cpu")
    message = str(info.value)
    assert f"checkpoint {str(short_dir)!r} has {params / 1e6:.2f}M parameters" in message
    assert f"{fp32 / (1 << 20):.1f} MiB in float32" in message
    assert "dtype='bfloat16' (1.5 MiB) would fit" in message
    _free(monkeypatch, 1 << 20)
    with pytest.raises(InsufficientMemoryError, match="in bfloat16 it would still need 1.5 MiB"):
        load_model(str(short_dir), device="cpu")
    with pytest.raises(InsufficientMemoryError, match="already loads in a 16-bit dtype"):
        load_model(str(short_dir), dtype="bfloat16", device="cpu")
