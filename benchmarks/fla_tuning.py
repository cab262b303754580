"""fla-core's autotuned kernels, for benchmarks that time fla as a baseline.

Several fla kernels autotune on keys without the problem size (the KDA conv update on (D, W),
AttnRes on the hidden size and a padded entry count), so a config tuned at one shape would be
kept at every other. And the autotuner's own pick, from a few short timings, varies between
runs: two H200 runs of benchmarks/kda_decode.py on 2026-12-01, both retuning at 36 rows, got
fla's conv update at 14 us (BD 256) and at ~44 us (BD 32). `fastest` therefore times the
baseline under every config of the tuner and keeps the best: fla at its best on each shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from triton.runtime.errors import OutOfResources


def autotuner(kernel):
    """The Triton autotuner under `kernel`'s wrappers (heuristics, ...): its `.cache` holds the
    tuned config per key."""
    while not hasattr(kernel, "cache") and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


@contextlib.contextmanager
def pinned(tuner, config) -> Iterator[None]:
    """Run `tuner`'s kernel with `config` only (an autotuner of one config does not tune)."""
    saved = tuner.configs
    tuner.configs = [config]
    tuner.cache.clear()
    try:
        yield
    finally:
        tuner.configs = saved
        tuner.cache.clear()


def fastest(tuner, time_it: Callable[[], float]) -> tuple[float, object]:
    """(min time, its config) of `time_it()` run once with each of `tuner`'s configs pinned.

    Configs the device cannot launch (out of shared memory or registers) are skipped.
    """
    best: tuple[float, object] | None = None
    for config in list(tuner.configs):
        with pinned(tuner, config):
            try:
                t = time_it()
            except OutOfResources:
                continue
        if best is None or t < best[0]:
            best = (t, config)
    if best is None:
        raise RuntimeError("no config of the fla kernel could run")
    return best
