"""The decorator for the cache's compiled loops: numba when it is installed, else the same code.

The cache's per-page bookkeeping (key tables, page refcounts, LRU queues, free lists) runs as
plain loops over numpy arrays. numba compiles them (cached on disk next to the source); without
numba the identical functions run in the interpreter: correct, but tens of times slower per page.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger("tokenspeed.cache")
F = TypeVar("F", bound=Callable)

# TOKENSPEED_CACHE_INTERPRETED=1 runs the loops in the interpreter even where numba is installed
# (tests check that the fallback computes the same); unset, empty or "0" leaves them compiled.
FORCE_INTERPRETED = os.environ.get("TOKENSPEED_CACHE_INTERPRETED", "0") not in ("", "0")
if FORCE_INTERPRETED:
    numba = None
else:
    try:
        import numba
        import numba.extending
    except ImportError:  # pragma: no cover - depends on the environment
        numba = None
        logger.warning(
            "numba is not installed: the cache's bookkeeping loops run interpreted (slow)"
        )

AVAILABLE = numba is not None


def jit(fn: F) -> F:
    """`fn` compiled (nopython, cached on disk) when numba is available, else `fn` itself."""
    if numba is None:
        return fn
    return numba.njit(cache=True, nogil=True)(fn)


def jitable(fn: F) -> F:
    """A helper for compiled loops: compiled into (and inlined by) the jitted functions that call
    it when numba is available; a plain function for the interpreted ones either way."""
    if numba is None:
        return fn
    return numba.extending.register_jitable(fn)
