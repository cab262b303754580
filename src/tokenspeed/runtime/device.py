"""Where an engine runs: the device it resolves to, its free memory, and CPU threads."""

from __future__ import annotations

import contextlib
import os

import torch

from tokenspeed.model import PRESETS, get_preset
from tokenspeed.model.loader import WeightFootprint, checkpoint_footprint, weight_footprint

from .config import EngineConfig, EngineConfigError

# Below this many parameters a model runs fastest single-threaded on the CPU: torch's intra-op
# threads cost more than they save on its small matrices, and they stall whenever another
# process holds a core (benchmarks/cpu_threads.py: the tiny preset, 1.03x idle and 6.6x with
# the other core busy on the 2-core dev machine; docs/perf/cpu_threads.md).
SINGLE_THREAD_PARAMS = 100_000_000


class InsufficientMemoryError(EngineConfigError):
    """Weights or a cache larger than the free memory of the device meant to hold them; raised
    before anything is allocated, the message saying what would fit."""


def resolve_device(device: str) -> torch.device:
    """`device` ("auto": CUDA when present, else the CPU) as a torch device this machine has;
    anything else (no CUDA, an index past the GPUs, a device type the engine does not run on)
    is an EngineConfigError naming it, before any model loads."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = None
    if isinstance(device, str):  # torch.device(3) is cuda:3
        with contextlib.suppress(RuntimeError, TypeError, ValueError):
            resolved = torch.device(device)
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise EngineConfigError(
            f"EngineConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}"
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineConfigError(
                f"EngineConfig.device is {device!r} but torch.cuda.is_available() is False (no "
                f"CUDA device, or a torch {torch.__version__} built without CUDA): use "
                "device='cpu' or 'auto'"
            )
        count = torch.cuda.device_count()
        if (resolved.index or 0) >= count:
            raise EngineConfigError(
                f"EngineConfig.device is {device!r} but this machine has {count} CUDA devices "
                f"(cuda:0 to cuda:{count - 1})"
            )
    return resolved


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory an allocation could take now on `device`, where it can be read: the GPU's free
    memory, or Linux's MemAvailable (free plus reclaimable page cache) for the host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
    return None


def apply_cpu_threads(config: EngineConfig, model: torch.nn.Module, device: torch.device) -> None:
    """torch's CPU threads for an engine on the CPU (a process-wide setting): `config.cpu_threads`
    when given, else one thread for a model under SINGLE_THREAD_PARAMS unless OMP_NUM_THREADS
    says otherwise; a GPU engine leaves them as they are."""
    if device.type != "cpu":
        return
    threads = config.cpu_threads
    if threads is None:
        if "OMP_NUM_THREADS" in os.environ:
            return
        if sum(p.numel() for p in model.parameters()) >= SINGLE_THREAD_PARAMS:
            return
        threads = 1
    torch.set_num_threads(threads)


def _size(nbytes: int) -> str:
    gib = 1 << 30
    return f"{nbytes / gib:.1f} GiB" if nbytes >= gib else f"{nbytes / (1 << 20):.1f} MiB"


def _params(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 10**9 else f"{count / 1e6:.2f}M"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _refuse_weights(
    label: str, footprint: WeightFootprint, device: torch.device, free: int, hint: str, note=""
):
    raise InsufficientMemoryError(
        f"{label} has {_params(footprint.num_params)} parameters: "
        f"{_size(footprint.nbytes)} in {_dtype_name(footprint.dtype)}{note}, but the "
        f"{device.type} device has {_size(free)} free; {hint}"
    )


def _preset_fits(name: str, dtype: torch.dtype, device: torch.device) -> bool:
    config = get_preset(name)
    host_free = free_memory_bytes(torch.device("cpu"))
    if host_free is not None and weight_footprint(config, torch.float32).nbytes > host_free:
        return False
    if device.type == "cpu":
        return True
    free = free_memory_bytes(device)
    return free is None or weight_footprint(config, dtype).nbytes <= free


def _presets_that_fit(dtype: torch.dtype, device: torch.device) -> str:
    fit = [name for name in PRESETS if _preset_fits(name, dtype, device)]
    return f"presets that fit: {', '.join(fit)}" if fit else "no preset fits"


def check_preset_fits(name: str, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a preset whose weights the memory cannot hold, before allocating any (past the
    free memory the allocator fails after minutes of work, or the kernel kills the process). Its
    random weights are made in float32 on the host, then cast and moved to `device`."""
    config = get_preset(name)
    host = torch.device("cpu")
    built = weight_footprint(config, torch.float32)
    free = free_memory_bytes(host)
    if free is not None and built.nbytes > free:
        note = (
            ""
            if device.type == "cpu" and dtype == torch.float32
            else f" (its random weights are made on the host in float32, then cast to "
            f"{_dtype_name(dtype)} on {device})"
        )
        _refuse_weights(
            f"preset {name!r}", built, host, free, _presets_that_fit(dtype, device), note
        )
    if device.type == "cpu":
        return
    final = weight_footprint(config, dtype)
    free = free_memory_bytes(device)
    if free is not None and final.nbytes > free:
        _refuse_weights(f"preset {name!r}", final, device, free, _presets_that_fit(dtype, device))


def check_checkpoint_fits(path, dtype: torch.dtype | str, device: torch.device) -> None:
    """Refuse a checkpoint whose weights (in the dtype they load in) `device` cannot hold, from
    its config.json alone, before any shard is read; say whether a 16-bit dtype would fit."""
    footprint = checkpoint_footprint(path, dtype)
    free = free_memory_bytes(device)
    if free is None or footprint.nbytes <= free:
        return
    if footprint.dtype.itemsize > 2:
        half = weight_footprint(footprint.config, torch.bfloat16, footprint.experts)
        hint = (
            f"dtype='bfloat16' ({_size(half.nbytes)}) would fit"
            if half.nbytes <= free
            else f"in bfloat16 it would still need {_size(half.nbytes)}"
        )
    else:
        hint = "it already loads in a 16-bit dtype: it needs a device with more memory"
    _refuse_weights(f"checkpoint {str(path)!r}", footprint, device, free, hint)
