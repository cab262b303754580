"""`ParallelConfig`: how many worker processes a multi-rank engine runs, and how they split the
model (attention data parallel on every rank, experts over `ep` ranks, projections over `tp`
subgroups; see docs/parallel.md).

    LLM("tiny", parallel=ParallelConfig(world_size=4, tp=2))   # 4 workers, DEP 4, TP pairs

Validated when built (`ParallelError` naming the numbers), and against the model's heads and
experts (`check_model`) before any worker process starts.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs

from tokenspeed.model import PRESETS, ModelConfig, from_hf_config, get_preset
from tokenspeed.parallel import ParallelDims, ParallelError

__all__ = ["ParallelConfig", "ParallelError", "model_config_of"]


def _count(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelError(f"ParallelConfig.{attribute.name} must be an int >= 1, got {value!r}")


def _optional_count(instance, attribute, value) -> None:
    if value is not None:
        _count(instance, attribute, value)


def _seconds(instance, attribute, value) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ParallelError(
            f"ParallelConfig.{attribute.name} must be a positive number of seconds, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """world_size: worker processes, one rank each (one GPU each on CUDA; gloo on the CPU).
    tp: TP subgroup size (projections and shared experts column parallel over `tp` consecutive
        ranks; attention and its cache stay data parallel). 1: none.
    ep: expert-parallel size of the routed experts (None: world_size, DEP over every rank).
    timeout_s: deadline of every collective (a rank that stops answering makes its peers fail
        instead of waiting forever).
    start_timeout_s: deadline for every worker to build its model and engine.
    stop_grace_s: how long a stopping worker may take to exit before it is killed.
    """

    world_size: int = attrs.field(validator=_count)
    tp: int = attrs.field(default=1, validator=_count)
    ep: int | None = attrs.field(default=None, validator=_optional_count)
    timeout_s: float = attrs.field(default=60.0, validator=_seconds)
    start_timeout_s: float = attrs.field(default=120.0, validator=_seconds)
    stop_grace_s: float = attrs.field(default=5.0, validator=_seconds)

    def __attrs_post_init__(self) -> None:
        self.dims()  # the degrees against each other (ParallelDims names the numbers)

    @property
    def expert_parallel(self) -> int:
        return self.world_size if self.ep is None else self.ep

    def dims(self) -> ParallelDims:
        """The layout of the ranks (validated)."""
        try:
            return ParallelDims(world_size=self.world_size, tp=self.tp, ep=self.expert_parallel)
        except ParallelError as exc:
            raise ParallelError(str(exc).replace("ParallelDims.", "ParallelConfig.")) from None

    def check_model(self, config: ModelConfig) -> None:
        """Refuse degrees the model cannot be split by (its heads, hidden size, experts)."""
        self.dims().check_model(config)


def model_config_of(model: str | Path) -> ModelConfig:
    """The configuration of a preset (by name) or of a checkpoint directory (its config.json),
    read without building the model."""
    if isinstance(model, str) and model in PRESETS:
        return get_preset(model)
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a preset {sorted(PRESETS)} nor a directory")
    return from_hf_config(path)
