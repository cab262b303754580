import pytest

from tests.sched.fake_cache import FakeCache, make_request
from tokenspeed.sched.aggregated import AggregatedScheduler
from tokenspeed.sched.config import SchedulerConfig
from tokenspeed.sched.request import RequestState

P = 16


def _sched(*, budget=128, pages=1000, sizes=(1, 2, 4, 8), on_preempt=None):
    cache = FakeCache(page_size=P, num_pages=pages)
    cfg = SchedulerConfig(
        page_size=P,
        prefill_token_budget=budget,
        checkpoint_interval_pages=4,
        decode_batch_sizes=sizes,
    )
    return AggregatedScheduler(cfg, cache, save_state_on_preempt=on_preempt), cache


def test_prefill_joins_decode_without_transfer_and_shares_the_budget():
    sched, _ = _sched(budget=128)
    a = make_request("a", 40, max_new_tokens=3)
    sched.add(a)
    plan = sched.schedule()
    assert plan.decode is None and plan.prefill.num_tokens == 40
    sched.complete(plan)
    assert a.state is RequestState.DECODING and list(sched.decode.running) == ["a"]
    b = make_request("b", 300)
    sched.add(b)
    plan = sched.schedule()
    # One decode row takes one token of the budget; prefill gets the rest, aligned (64 of 127).
    assert plan.decode.size == 1 and plan.decode.padded_size == 1
    assert [(c.start, c.end) for c in plan.prefill.chunks] == [(0, 64)]
    sched.complete(plan)
    assert a.num_output == 2


def test_multi_step_decode_only_when_no_prefill_pending():
    sched, _ = _sched()
    a = make_request("a", 40, max_new_tokens=20)
    sched.add(a)
    sched.complete(sched.schedule())
    plan = sched.schedule(max_decode_steps=50)
    assert plan.prefill is None and plan.decode.steps == 19
    sched.add(make_request("b", 40))
    plan2 = sched.schedule(max_decode_steps=50)
    assert plan2.decode.steps == 1 and plan2.prefill is not None
    with pytest.raises(ValueError, match="single forward"):
        sched.complete(plan2, decode_steps=2)


def test_finishes_flow_out_and_abort_reaches_both_stages():
    sched, cache = _sched()
    one, two, slow = (make_request(r, 20, n) for r, n in (("one", 1), ("two", 2), ("slow", 9)))
    for r in (one, two, slow):
        sched.add(r)
    done = sched.complete(sched.schedule())
    assert done == [one]  # a one-token answer ends in prefill
    done = sched.complete(sched.schedule())
    assert done == [two]
    queued = make_request("queued", 500)
    sched.add(queued)
    assert sched.abort("slow", "x") is slow and slow.state is RequestState.ABORTED
    assert sched.abort("queued", "x") is queued and queued.state is RequestState.ABORTED
    assert not sched.has_work and cache.used_pages == 0


def test_admission_stops_at_the_decode_cap():
    sched, _ = _sched(sizes=(1, 2))
    reqs = [make_request(f"r{i}", 16, 5) for i in range(3)]
    for r in reqs:
        sched.add(r)
    sched.complete(sched.schedule())
    assert [r.state for r in reqs] == [RequestState.DECODING] * 2 + [RequestState.WAITING]
    plan = sched.schedule()
    assert plan.prefill is None and plan.decode.size == 2


def test_preempted_and_aborted_are_handed_to_the_caller():
    sched, _ = _sched(pages=7, budget=256)
    a, b = make_request("a", 47, 30), make_request("b", 47, 30)
    sched.add(a)
    sched.add(b)
    sched.complete(sched.schedule())  # both prefilled: 3 pages each
    sched.complete(sched.schedule())
    sched.schedule()  # both need a 4th page, 1 free
    assert sched.take_preempted() == [b] and sched.take_preempted() == []
    assert b.state is RequestState.WAITING
    assert sched.take_aborted() == []


def test_a_prefill_whose_first_token_stops_finishes_without_decoding():
    from tokenspeed.sched import AggregatedScheduler, Request, RequestState, SchedulerConfig

    from .fake_cache import FakeCache

    cache = FakeCache(page_size=16, num_pages=64)
    sched = AggregatedScheduler(SchedulerConfig(page_size=16, prefill_token_budget=64), cache)
    req = Request("a", 20, 10, keys=[("a", 0), ("a", 1)])
    sched.add(req)
    plan = sched.schedule()
    done = sched.complete(plan, finished={"a"})
    assert done == [req] and req.state is RequestState.FINISHED and req.num_output == 1
    assert not sched.has_work


def test_a_failing_state_copy_leaves_every_request_somewhere_it_can_be_aborted():
    """The engine's save_state raises (a device copy failed) while a step's prefill chunks are
    completed: chunks before it are done with (their requests decode), the failing one is still
    running its prefill, and aborting it frees its cache; nothing is stranded in between."""
    sched, cache = _sched(budget=512)
    a, b = make_request("a", 32, max_new_tokens=5), make_request("b", 200, max_new_tokens=5)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    # a's only checkpoint is its chunk's end (from the live state); b's first is inside its chunk.
    assert [(c.request.rid, c.checkpoints[0] < c.end) for c in plan.prefill.chunks] == [
        ("a", False),
        ("b", True),
    ]

    def failing(req, pos, slot):
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        sched.complete(plan, save_state=failing)
    assert a.state is RequestState.DECODING and "a" in sched.decode.running
    assert b.state is RequestState.PREFILLING and "b" in sched.prefill.running
    assert sched.abort("b", "step failed") is b and not cache.holds("b")
    assert b.state is RequestState.ABORTED


def test_a_lone_decode_row_blocked_by_prefill_pages_is_preempted_not_aborted():
    """The only decode row needs a page while a running prefill holds the rest. Before, it was
    aborted as having "outgrown the rank's device cache", though it fits the rank easily and
    only waits on the prefill: a request lost. It is preempted (back to the caller, its history
    published) instead, and the prefill goes on."""
    sched, cache = _sched(budget=64, pages=8)
    d = make_request("d", 16, max_new_tokens=40)
    sched.add(d)
    for _ in range(3):
        sched.complete(sched.schedule())
    assert d.state is RequestState.DECODING and cache.pages == {"d": 2}
    big = make_request("big", 200)
    sched.add(big)
    while d.state is RequestState.DECODING:
        sched.complete(sched.schedule())
    assert d.state is RequestState.WAITING and sched.take_preempted() == [d]
    assert sched.take_aborted() == [] and not cache.holds("d")
    assert big.state is RequestState.PREFILLING


def test_a_second_live_request_under_one_id_is_refused_at_add():
    """A decoding request's id was not checked by the prefill side: the duplicate was queued and
    its admission failed on the cache (the id holds cache) at every step, stopping the rank."""
    sched, _ = _sched()
    a = make_request("a", 20, max_new_tokens=10)
    sched.add(a)
    sched.complete(sched.schedule())
    assert a.state is RequestState.DECODING
    with pytest.raises(ValueError, match="already queued or running"):
        sched.add(make_request("a", 20))
    assert sched.schedule().decode.requests == (a,)


def test_a_preempted_row_behind_its_live_state_is_saved_through_the_constructor_callback():
    """The callback given at construction writes a preempted row's turn end when the live state
    has moved past its last full page (the engine passes its state keeper's `save_state`)."""
    saved = []
    sched, cache = _sched(on_preempt=lambda req, pos, slot: saved.append((req.rid, pos, slot)))
    d = make_request("d", 16, max_new_tokens=40)
    sched.add(d)
    while d.num_computed < 35:  # joins decoding at 16; 35 is past the page boundary at 32
        sched.complete(sched.schedule())
    assert sched.decode.preempt("d") is d and d.state is RequestState.WAITING
    assert [(rid, pos) for rid, pos, _ in saved] == [("d", 32)]
    assert ("d", 32, True, False) in cache.kinds  # a turn end, its state not from the live slot
