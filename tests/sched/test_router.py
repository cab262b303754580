import pytest

from tests.sched.fake_cache import FakeCache, make_request
from tokenspeed.sched import PrefillScheduler, RequestState, SchedulerConfig
from tokenspeed.sched.config import RouterConfig, RoutingPolicy
from tokenspeed.sched.router import DecodeLoad, Router


def test_prefill_goes_to_least_outstanding_work():
    router = Router(RouterConfig(num_prefill_ranks=4, num_decode_ranks=1))
    assert router.pick_prefill([900, 120, 5_000, 300]) == 1
    assert router.pick_prefill([0, 10, 10, 10]) == 0
    assert router.pick_prefill([10, 10, 10, 3]) == 3


def test_ties_rotate_instead_of_piling_on_rank_zero():
    router = Router(RouterConfig(num_prefill_ranks=3))
    picks = [router.pick_prefill([0, 0, 0]) for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_least_work_ignores_conversation_history():
    router = Router(RouterConfig(num_prefill_ranks=2))
    assert router.pick_prefill([0, 50], session="s") == 0
    assert router.pick_prefill([70, 50], session="s") == 1


def test_affinity_keeps_a_conversation_on_its_first_rank():
    router = Router(RouterConfig(num_prefill_ranks=3, policy=RoutingPolicy.AFFINITY))
    first = router.pick_prefill([500, 0, 900], session="conv-a")
    assert first == 1
    # Later turns stick even when that rank is now the busiest.
    assert router.pick_prefill([0, 10_000, 0], session="conv-a") == 1
    # Another conversation is placed by least work.
    assert router.pick_prefill([0, 10_000, 5], session="conv-b") == 0
    router.forget("conv-a")
    assert router.pick_prefill([3, 10_000, 0], session="conv-a") == 2


def test_decode_by_load_then_free_pages():
    router = Router(RouterConfig(num_prefill_ranks=1, num_decode_ranks=3))
    loads = [DecodeLoad(5, 100), DecodeLoad(2, 10), DecodeLoad(2, 400)]
    assert router.pick_decode(loads) == 2
    assert router.pick_decode([DecodeLoad(1, 0), DecodeLoad(3, 999), DecodeLoad(2, 9)]) == 0


def test_load_vector_must_match_rank_count():
    router = Router(RouterConfig(num_prefill_ranks=2, num_decode_ranks=2))
    with pytest.raises(ValueError, match="2 ranks"):
        router.pick_prefill([1, 2, 3])
    with pytest.raises(ValueError, match="2 ranks"):
        router.pick_decode([DecodeLoad(0, 1)])


def test_router_on_live_prefill_queues_counts_queued_work_and_prefix_hits():
    """The load the router compares is each rank's `outstanding_tokens()`: running prefills'
    remaining tokens plus queued requests' expected work (prompt minus the prefix they hit)."""
    cfg = SchedulerConfig(page_size=16, prefill_token_budget=256, checkpoint_interval_pages=4)
    ranks = [PrefillScheduler(cfg, FakeCache(page_size=16), disaggregated=True) for _ in range(3)]
    router = Router(RouterConfig(num_prefill_ranks=3, num_decode_ranks=1))

    def loads():
        return [r.outstanding_tokens() for r in ranks]

    # Rank 0: one long prompt part-way through its prefill (1000 - 256 = 744 left).
    ranks[0].add(make_request("long", 1000))
    ranks[0].complete(ranks[0].schedule())
    # Rank 1: nothing running, but three queued prompts (3 x 300 = 900 tokens to compute).
    for i in range(3):
        ranks[1].add(make_request(f"q{i}", 300))
    # Rank 2: a 900-token prompt whose first 640 tokens it has cached: 260 to compute.
    warm = make_request("warm", 640, content="conv")
    ranks[2].add(warm)
    while warm.state is not RequestState.TRANSFERRING:
        ranks[2].complete(ranks[2].schedule())
    ranks[2].release(warm)
    ranks[2].add(make_request("hit", 900, content="conv"))
    assert loads() == [744, 900, 900 - 640]
    assert router.pick_prefill(loads()) == 2
    # Queued work counts at once: two more queued prompts on rank 2 make rank 0 the lightest,
    # although rank 0 is the only one computing right now.
    ranks[2].add(make_request("more0", 300))
    ranks[2].add(make_request("more1", 300))
    assert loads() == [744, 900, 860]
    assert router.pick_prefill(loads()) == 0


def test_decode_pick_without_decode_ranks_is_a_clear_error():
    """An aggregated cluster has no decode ranks; before, the empty load list passed the length
    check and the tie rotation divided by zero."""
    router = Router(RouterConfig(num_prefill_ranks=2))
    with pytest.raises(ValueError, match="no decode ranks"):
        router.pick_decode([])
