"""Where an engine runs: the device it resolves to, its free memory, and CPU threads."""

from __future__ import annotations

import os

import torch

from .config import EngineConfig

# Below this many parameters a model runs fastest single-threaded on the CPU: torch's intra-op
# threads cost more than they save on its small matrices, and they stall whenever another
# process holds a core (benchmarks/cpu_threads.py: the tiny preset, 1.03x idle and 6.6x with
# the other core busy on the 2-core dev machine; docs/perf/runtime.md).
SINGLE_THREAD_PARAMS = 100_000_000


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
