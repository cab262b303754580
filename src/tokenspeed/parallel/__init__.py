"""Parallel strategies as transforms of a built model (see docs/parallel.md).

A model is built for one device (`tokenspeed.model`); a strategy rewrites its modules in place
for one rank of a layout (`ParallelDims`), communicating through the process groups of that
layout (`ParallelGroups`). `parallelize` applies a plan of strategies in a defined order. This
package imports the model, never the other way round.
"""

from .comm import CommLog
from .dcp import apply_dcp
from .dep import apply_dep, gather_load, load_imbalance, report_load, reset_load
from .dims import ParallelDims, ParallelError
from .dwdp import apply_dwdp
from .groups import ParallelGroups, backend_for
from .loading import load_rank_checkpoint
from .plan import Registry, Strategy, default_registry, parallelize
from .random_init import init_rank_random_weights
from .report import TransformReport
from .shards import mark_shard
from .tp import apply_tp
from .tp_subgroup import apply_tp_subgroup

__all__ = [
    "CommLog",
    "ParallelDims",
    "ParallelError",
    "ParallelGroups",
    "Registry",
    "Strategy",
    "TransformReport",
    "apply_dcp",
    "apply_dep",
    "apply_dwdp",
    "apply_tp",
    "apply_tp_subgroup",
    "backend_for",
    "default_registry",
    "gather_load",
    "init_rank_random_weights",
    "load_imbalance",
    "load_rank_checkpoint",
    "mark_shard",
    "parallelize",
    "report_load",
    "reset_load",
]
