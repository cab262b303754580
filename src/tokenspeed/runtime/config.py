"""`EngineConfig`: everything an engine needs besides the model."""

from __future__ import annotations

import attrs
import torch
from attrs import field, frozen

from tokenspeed.sched.config import MAX_DECODE_BATCH_SIZE

from .sampling_params import is_int
from .spec.config import SpeculativeConfig

# max_model_len when none is given: the model's limit, but no more than this (a checkpoint's
# max_position_embeddings may be a million tokens, whose default cache would not fit anywhere).
DEFAULT_MAX_MODEL_LEN = 8192


class EngineConfigError(ValueError):
    """An engine configuration that cannot work; the message names the field."""


def _positive(instance, attribute, value) -> None:
    if value is not None and (not is_int(value) or value <= 0):
        raise EngineConfigError(
            f"EngineConfig.{attribute.name} must be a positive integer, got {value!r}"
        )


def _integer(instance, attribute, value) -> None:
    if not is_int(value):
        raise EngineConfigError(f"EngineConfig.{attribute.name} must be an integer, got {value!r}")


def _switch(instance, attribute, value) -> None:
    # bool() of "no" or "false" is True: a switch takes exactly True or False.
    if not isinstance(value, bool):
        raise EngineConfigError(
            f"EngineConfig.{attribute.name} must be True or False, got {value!r}"
        )


def _non_negative(instance, attribute, value) -> None:
    if not is_int(value) or value < 0:
        raise EngineConfigError(
            f"EngineConfig.{attribute.name} must be a non-negative integer, got {value!r}"
        )


def _at_most_max_decode_batch(instance, attribute, value) -> None:
    # Every decode graph size is at most max_num_seqs and the largest equals it (see
    # graph_sizes); the scheduler refuses sizes past MAX_DECODE_BATCH_SIZE, so say it here.
    if value > MAX_DECODE_BATCH_SIZE:
        raise EngineConfigError(
            f"EngineConfig.{attribute.name} is {value}, above the largest decode batch "
            f"{MAX_DECODE_BATCH_SIZE} (one CUDA graph and its buffers are built per batch size)"
        )


def _speculative(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, SpeculativeConfig):
        raise EngineConfigError(
            f"EngineConfig.speculative must be a SpeculativeConfig or None, got {value!r}"
        )


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
KDA_CHECKPOINT_DTYPES = ("float32", "bfloat16")


def _one_of(choices: tuple[str, ...]):
    def check(instance, attribute, value) -> None:
        if not isinstance(value, str) or value not in choices:
            raise EngineConfigError(
                f"EngineConfig.{attribute.name} must be one of {', '.join(map(repr, choices))}, "
                f"got {value!r}"
            )

    return check


def _optional_sizes(value):
    # tuple() of a bare int fails with "'int' object is not iterable", which names no field.
    if value is None:
        return None
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise EngineConfigError(
            f"EngineConfig.decode_batch_sizes must be a sequence of integers, got {value!r}"
        )
    return tuple(value)


@frozen(kw_only=True)
class EngineConfig:
    """How the engine runs a model.

    device: "auto" (CUDA when present) or a torch device string.
    page_size: tokens per cache page.
    cache_budget_bytes: device-tier bytes (None: room for max_num_seqs requests of max_model_len
        tokens, twice over). A budget that cannot hold one request of max_model_len tokens
        (beside the live KDA slots of max_num_seqs requests and the checkpoint slots) is refused
        when the engine is built: requests would be aborted as they outgrew it.
    checkpoint_slots: KDA checkpoint slots carved from the budget (None: 4 per request with the
        default budget, else a fraction of the budget).
    max_num_seqs: requests holding cache at once, also the largest decode batch (at most
        MAX_DECODE_BATCH_SIZE).
    max_model_len: longest prompt + output, at most the model's `max_position_embeddings`
        (None: that limit, capped at DEFAULT_MAX_MODEL_LEN = 8192 tokens, whose default cache
        fits the machines the engine is tested on; `Engine` resolves it from its model, see
        `tokenspeed.runtime.cache_sizing.fit_config`).
    prefill_token_budget: new tokens per prefill forward.
    decode_batch_sizes: padded decode sizes (the CUDA graph sizes), strictly increasing and
        ending at max_num_seqs; default powers of two up to max_num_seqs.
    l2: "local" (an in-process host tier) or "none"; pass a `tokenspeed.cache.HostCache` to
        `Engine` to share one (e.g. Mooncake).
    enable_cuda_graph: capture decode steps (CUDA only; eager on CPU).
    checkpoint_interval_pages: KDA checkpoints every N pages of a long prefill.
    seed: the sampler's default generator.
    decode_steps: decode steps run back to back when no prefill is pending (multi-step
        decoding): each step's input tokens come from the previous step's samples on the device,
        and the host syncs, checks stops and schedules once per `decode_steps` tokens instead of
        once per token. Outputs then arrive up to that many tokens at a time, and a row that
        stops inside a run computes the rest of the run's steps for nothing (never emitted).
        A row that crosses a page boundary inside a run keeps a copy of its KDA state until the
        run ends (at most one per row while decode_steps <= page_size). 1 (the default)
        returns after every token.
    cpu_threads: torch's CPU threads for an engine on the CPU (process-wide). None: one thread
        for a model under 100M parameters unless OMP_NUM_THREADS is set (small models lose to
        thread overhead, and stall badly when another process holds a core), else torch's own.
    speculative: a `tokenspeed.runtime.spec.SpeculativeConfig` to speculate decode rows
        (docs/spec.md); None (the default): plain decoding. Speculation runs one verify forward
        per step, so it needs decode_steps = 1.
    kv_cache_dtype: the MLA cache's rows: "auto" (the model's dtype, the default) or "fp8_e4m3"
        (e4m3 rows with one fp32 scale per row, the e4m3 MLA kernels' per-row scheme: a
        512 + 64 wide row takes 580 bytes instead of 1152 in bf16). Every step attends to the
        rows as stored, so prefix hits and chunking change no token; a different cache dtype is a
        different cache layout (never shares L2 objects with the other).
    kda_checkpoint_dtype: KDA checkpoints (device checkpoint slots and L2 objects): "float32"
        (the default: exact copies of the live state) or "bfloat16" (half the bytes; the live
        recurrent state stays fp32 and a restore converts up).
    """

    device: str = "auto"
    page_size: int = field(default=64, validator=_positive)
    cache_budget_bytes: int | None = field(default=None, validator=_positive)
    checkpoint_slots: int | None = field(default=None, validator=_positive)
    max_num_seqs: int = field(default=32, validator=[_positive, _at_most_max_decode_batch])
    max_model_len: int | None = field(default=None, validator=_positive)
    prefill_token_budget: int = field(default=8192, validator=_positive)
    decode_batch_sizes: tuple[int, ...] | None = field(default=None, converter=_optional_sizes)
    l2: str = "local"
    l2_capacity_bytes: int = field(default=1 << 30, validator=_positive)
    enable_cuda_graph: bool = field(default=True, validator=_switch)
    checkpoint_interval_pages: int = field(default=64, validator=_positive)
    max_preemptions: int = field(default=8, validator=_non_negative)
    seed: int = field(default=0, validator=_integer)
    decode_steps: int = field(default=1, validator=_positive)
    cpu_threads: int | None = field(default=None, validator=_positive)
    speculative: SpeculativeConfig | None = field(default=None, validator=_speculative)
    kv_cache_dtype: str = field(default="auto", validator=_one_of(KV_CACHE_DTYPES))
    kda_checkpoint_dtype: str = field(default="float32", validator=_one_of(KDA_CHECKPOINT_DTYPES))

    def __attrs_post_init__(self) -> None:
        if self.l2 not in ("local", "none"):
            raise EngineConfigError(f"EngineConfig.l2 must be 'local' or 'none', got {self.l2!r}")
        if self.prefill_token_budget < self.page_size:
            raise EngineConfigError(
                f"EngineConfig.prefill_token_budget ({self.prefill_token_budget}) is smaller than "
                f"a page ({self.page_size})"
            )
        if self.decode_batch_sizes is not None:
            self._check_decode_batch_sizes(self.decode_batch_sizes)
        if self.speculative is not None and self.decode_steps != 1:
            raise EngineConfigError(
                f"EngineConfig.decode_steps is {self.decode_steps}, but speculative decoding "
                "runs one verify forward per step: decode_steps must be 1"
            )

    def _check_decode_batch_sizes(self, sizes: tuple[int, ...]) -> None:
        """The largest size is the decode batch cap and max_num_seqs the number of requests that
        can decode at once, so the two must agree. Ending below max_num_seqs would cap decode
        below the requests admitted; an entry past max_num_seqs would never run, and dropping
        it could leave a smaller cap behind, silently (sizes (1, 2, 4, 64) with 32 requests
        would decode at most 4 at a time)."""
        if (
            not sizes
            or not all(is_int(s) for s in sizes)
            or list(sizes) != sorted(set(sizes))
            or sizes[0] <= 0
        ):
            raise EngineConfigError(
                f"EngineConfig.decode_batch_sizes must be strictly increasing positive ints, "
                f"got {sizes!r}"
            )
        if sizes[-1] != self.max_num_seqs:
            raise EngineConfigError(
                f"EngineConfig.decode_batch_sizes must end at max_num_seqs "
                f"({self.max_num_seqs}), the largest decode batch, but ends at {sizes[-1]}: "
                f"got {sizes!r}"
            )

    @property
    def cache_dtypes(self) -> dict:
        """`CacheGeometry.from_model_config`'s mla_dtype and kda_checkpoint_dtype for the two
        cache dtype fields (None: as the model / the live state, today's layout)."""
        return {
            "mla_dtype": torch.float8_e4m3fn if self.kv_cache_dtype == "fp8_e4m3" else None,
            "kda_checkpoint_dtype": (
                torch.bfloat16 if self.kda_checkpoint_dtype == "bfloat16" else None
            ),
        }

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        if self.decode_batch_sizes is not None:
            return self.decode_batch_sizes
        sizes, size = [], 1
        while size < self.max_num_seqs:
            sizes.append(size)
            size *= 2
        return (*sizes, self.max_num_seqs)

    @property
    def max_pages_per_request(self) -> int:
        if self.max_model_len is None:
            raise EngineConfigError(
                "EngineConfig.max_model_len is None (the model's limit) until an engine resolves "
                "it against its model: read engine.config, or pass max_model_len"
            )
        return -(-self.max_model_len // self.page_size)

    def evolve(self, **changes) -> EngineConfig:
        return attrs.evolve(self, **changes)
