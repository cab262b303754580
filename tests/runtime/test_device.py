"""Where an engine runs: its device, and torch's CPU threads for a small model on the CPU."""

import pytest
import torch

from tokenspeed import LLM
from tokenspeed.runtime import Engine, EngineConfig, EngineConfigError
from tokenspeed.runtime.device import resolve_device


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    """Engines set torch's (process-wide) thread count: put it back for other tests, and start
    from a count that is not the one expected, without OMP_NUM_THREADS unless a test sets it."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


def _small(**options) -> EngineConfig:
    return EngineConfig(device="cpu", max_model_len=128, max_num_seqs=2, **options)


def test_llm_on_the_cpu_runs_a_small_model_single_threaded_by_default():
    LLM("tiny", device="cpu", max_model_len=128, max_num_seqs=2)
    assert torch.get_num_threads() == 1


def test_an_engine_on_the_cpu_runs_a_small_model_single_threaded_by_default(tiny):
    Engine(tiny, None, _small())
    assert torch.get_num_threads() == 1


def test_cpu_threads_sets_the_count_and_omp_num_threads_is_left_alone(tiny, monkeypatch):
    Engine(tiny, None, _small(cpu_threads=2))
    assert torch.get_num_threads() == 2
    LLM("tiny", device="cpu", max_model_len=128, max_num_seqs=2, cpu_threads=2)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    Engine(tiny, None, _small())
    assert torch.get_num_threads() == 3  # the environment's choice stands


@pytest.mark.parametrize("value", [0, -1, "2", 2.0, True])
def test_bad_cpu_threads_are_refused_naming_the_field(value):
    with pytest.raises(EngineConfigError, match="EngineConfig.cpu_threads"):
        EngineConfig(cpu_threads=value)


def test_engine_config_documents_cpu_threads():
    doc = EngineConfig.__doc__
    assert "cpu_threads:" in doc and "OMP_NUM_THREADS" in doc


def _no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_refused_naming_the_device(monkeypatch, device):
    _no_cuda(monkeypatch)
    with pytest.raises(EngineConfigError) as info:
        resolve_device(device)
    message = str(info.value)
    assert repr(device) in message and "torch.cuda.is_available() is False" in message


def test_a_cuda_index_past_the_machines_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(EngineConfigError, match=r"'cuda:3'.*2 CUDA devices \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:3")


@pytest.mark.parametrize("device", ["tpu", "garbage", "", "cuda:x", "cpu:0:1", 3, None])
def test_devices_torch_cannot_run_here_are_refused(device):
    with pytest.raises(EngineConfigError, match="EngineConfig.device"):
        resolve_device(device)


def test_auto_and_cpu_resolve(monkeypatch):
    _no_cuda(monkeypatch)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_llm_refuses_cuda_without_cuda_before_loading_the_model(monkeypatch):
    _no_cuda(monkeypatch)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("tokenspeed.runtime.llm.load_model", refuse)
    with pytest.raises(EngineConfigError, match="torch.cuda.is_available"):
        LLM("tiny", device="cuda")
