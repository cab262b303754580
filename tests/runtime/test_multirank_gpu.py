"""On a GPU: the multi-rank engine as a one-rank NCCL group (the worker process, its NCCL process
group, the lockstep protocol and the DEP MoE with one expert rank) gives the single-process
engine's greedy tokens, with and without captured decode graphs."""

from __future__ import annotations

import pytest

from tokenspeed import LLM
from tokenspeed.runtime.parallel_config import ParallelConfig

from .test_multirank import OPTIONS, scenario

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_one_rank_nccl_group_matches_single_process(graphs):
    # bf16 pages on CUDA (fp32 on the CPU) beside the same fp32 KDA slots: a smaller budget
    # gives about the CPU test's page count, so that the cache still preempts.
    budget = 360_000
    options = {
        **OPTIONS,
        "device": "cuda",
        "enable_cuda_graph": graphs,
        "cache_budget_bytes": budget,
    }
    single = scenario(LLM("tiny", **options))
    llm = LLM("tiny", parallel=ParallelConfig(world_size=1), **options)
    try:
        got = scenario(llm)
        assert llm.engine.worker_pids and llm.engine.mode == "dep"
    finally:
        llm.close()
    assert got["tokens"] == single["tokens"]
    assert single["preemptions"] > 0 and got["preemptions"] > 0
    assert got["second_turn_hits"] == single["second_turn_hits"] > 0
