"""Parallel strategies as transforms of a built model (see docs/parallel.md).

A model is built for one device (`tokenspeed.model`); a strategy rewrites its modules in place
for one rank of a layout (`ParallelDims`), communicating through the process groups of that
layout (`ParallelGroups`). This package imports the model, never the other way round.
"""

from .comm import CommLog
from .dims import ParallelDims, ParallelError
from .groups import ParallelGroups, backend_for

__all__ = ["CommLog", "ParallelDims", "ParallelError", "ParallelGroups", "backend_for"]
