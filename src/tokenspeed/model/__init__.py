"""The model: configs, reference ops, layers, the decoder and checkpoint loading.

This package imports nothing else of tokenspeed and never calls torch.distributed.
"""

from .batch import BatchError, ForwardBatch
from .config import (
    ActivationConfig,
    ConfigError,
    KdaConfig,
    MlaConfig,
    ModelConfig,
    MoeConfig,
)
from .hf_config import from_hf_config, to_hf_config
from .kimi import ForwardOutput, KimiForCausalLM
from .presets import PRESETS, get_preset
from .state import DecoderState, KdaState, PagedKda, PagedMla, PagedState

__all__ = [
    "PRESETS",
    "ActivationConfig",
    "BatchError",
    "ConfigError",
    "DecoderState",
    "ForwardBatch",
    "ForwardOutput",
    "KdaConfig",
    "KdaState",
    "KimiForCausalLM",
    "MlaConfig",
    "ModelConfig",
    "MoeConfig",
    "PagedKda",
    "PagedMla",
    "PagedState",
    "from_hf_config",
    "get_preset",
    "to_hf_config",
]
