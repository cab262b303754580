"""The runtime: model runner, CUDA graphs, sampler, engine loop, offline API."""

from .config import EngineConfig, EngineConfigError
from .engine import Engine, RequestError, StepError
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingError, SamplingParams

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "RequestError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingError",
    "SamplingParams",
    "StepError",
]
