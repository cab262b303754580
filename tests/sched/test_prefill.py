import pytest

from tests.sched.fake_cache import FakeCache, make_request
from tokenspeed.sched.config import SchedulerConfig
from tokenspeed.sched.prefill import PrefillScheduler
from tokenspeed.sched.request import RequestState

P = 16


def _sched(*, budget=128, pages=1000, disaggregated=True, live=100, max_reqs=64, max_preempt=8):
    cache = FakeCache(page_size=P, num_pages=pages, live_slots=live)
    cfg = SchedulerConfig(
        page_size=P,
        prefill_token_budget=budget,
        checkpoint_interval_pages=4,
        max_prefill_requests=max_reqs,
        decode_batch_sizes=(1, 2, 4, 8),
        max_preemptions=max_preempt,
    )
    return PrefillScheduler(cfg, cache, disaggregated=disaggregated), cache


def test_batch_fills_the_budget_fifo_with_aligned_cuts():
    sched, _ = _sched(budget=128)
    a, b, c = (make_request(x, n) for x, n in (("a", 40), ("b", 200), ("c", 30)))
    for r in (a, b, c):
        sched.add(r)
    batch = sched.schedule()
    got = [(ch.request.rid, ch.start, ch.end) for ch in batch.chunks]
    # a fits whole (40); b gets 88 tokens of budget -> cut at the interval boundary 64; the 24
    # tokens left give c one page.
    assert got == [("a", 0, 40), ("b", 0, 64), ("c", 0, 16)]
    assert batch.num_tokens == 120 <= 128
    assert a.state is b.state is c.state is RequestState.PREFILLING
    assert batch.chunks[1].checkpoints == (64,) and not batch.chunks[1].is_last


def test_running_requests_continue_before_new_admissions():
    sched, _ = _sched(budget=128)
    big, small = make_request("big", 300), make_request("small", 20)
    sched.add(big)
    sched.complete(sched.schedule())  # big: [0, 128)
    sched.add(small)
    batch = sched.schedule()
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("big", 128, 256)]
    sched.complete(batch)
    batch = sched.schedule()
    # Continuing chunk first; the 44-token tail plus 20 of small fit together.
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [
        ("big", 256, 300),
        ("small", 0, 20),
    ]


def test_prefix_hit_skips_cached_tokens_and_leaves_last_token():
    sched, cache = _sched(budget=1024)
    first = make_request("t1", 200, content="conv")
    sched.add(first)
    batch = sched.schedule()
    assert batch.chunks[0].checkpoints == (64, 128, 192)  # interval + turn-end (192 = 12 pages)
    sched.complete(batch)
    assert cache.calls("publish", "t1") == [("publish", "t1", 192)]
    # Same content again: reuse up to the deepest checkpoint, recompute the rest.
    second = make_request("t2", 200, content="conv")
    sched.add(second)
    assert sched.outstanding_tokens() == 200 - 192
    batch = sched.schedule()
    chunk = batch.chunks[0]
    assert (chunk.start, chunk.end) == (192, 200)
    assert second.num_cached == 192
    sched.complete(batch)
    # A prompt that is entirely cached still recomputes its last token for the logits, from the
    # deepest checkpoint below its end (128; there is none at 176).
    third = make_request("t3", 192, content="conv")
    sched.add(third)
    chunk = sched.schedule().chunks[0]
    assert (chunk.start, chunk.end) == (128, 192)


def test_outstanding_tokens_counts_queued_and_running():
    sched, _ = _sched(budget=64)
    sched.add(make_request("a", 100))
    sched.add(make_request("b", 50))
    assert sched.outstanding_tokens() == 150
    sched.complete(sched.schedule())
    assert sched.outstanding_tokens() == 150 - 64


def test_pd_completion_pins_until_release():
    sched, cache = _sched()
    req = make_request("r", 40, max_new_tokens=5)
    sched.add(req)
    done = sched.complete(sched.schedule())
    assert done == [req]
    assert req.state is RequestState.TRANSFERRING
    assert req.num_output == 1  # the prefill's forward sampled the first token
    assert sched.pinned == {"r": req} and cache.holds("r")
    sched.release(req)
    assert not cache.holds("r") and not sched.pinned
    with pytest.raises(KeyError):
        sched.release(req)


def test_aggregated_completion_goes_to_decoding():
    sched, cache = _sched(disaggregated=False)
    req = make_request("r", 40)
    sched.add(req)
    sched.complete(sched.schedule())
    assert req.state is RequestState.DECODING and cache.holds("r")


def test_one_token_answer_finishes_in_prefill():
    sched, cache = _sched()
    req = make_request("r", 40, max_new_tokens=1)
    sched.add(req)
    assert sched.complete(sched.schedule()) == [req]
    assert req.state is RequestState.FINISHED and not cache.holds("r")


def test_no_live_slot_keeps_fifo_order():
    sched, _ = _sched(live=1)
    a, b = make_request("a", 40), make_request("b", 10)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [c.request.rid for c in batch.chunks] == ["a"]
    assert list(sched.waiting) == [b]


def test_out_of_pages_waits_while_pinned_results_hold_pages():
    sched, _ = _sched(pages=5, budget=256)
    a = make_request("a", 64)
    sched.add(a)
    sched.complete(sched.schedule())  # a pinned with 4 pages
    b = make_request("b", 64)
    sched.add(b)
    batch = sched.schedule()  # one page left: an aligned 16-token chunk
    assert [(c.start, c.end) for c in batch.chunks] == [(0, 16)]
    sched.complete(batch)
    assert sched.schedule() is None  # waits: the pinned request will free its pages
    assert b.state is RequestState.PREFILLING
    sched.release(a)
    assert sched.schedule().chunks[0].end == 64


def test_lone_prefill_that_cannot_grow_is_aborted_with_reason():
    sched, cache = _sched(pages=6, budget=64)
    a, b = make_request("a", 200), make_request("b", 200)
    sched.add(a)
    sched.add(b)
    sched.complete(sched.schedule())  # a: [0, 64) = 4 pages
    batch = sched.schedule()  # a needs 4 more pages, only 2 free -> a shorter aligned chunk
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("a", 64, 96)]
    assert b.state is RequestState.WAITING  # no page left for b: it stays queued
    sched.complete(batch)
    # a holds all 6 pages and can never finish on this rank: aborted, and b gets the rank.
    batch = sched.schedule()
    assert a.state is RequestState.ABORTED and "more device pages" in a.abort_reason
    assert sched.aborted == [a] and not cache.holds("a")
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("b", 0, 64)]


def test_deadlock_between_partial_prefills_preempts_the_younger():
    sched, cache = _sched(pages=10, budget=96)
    a, b = make_request("a", 200), make_request("b", 200)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("a", 0, 64), ("b", 0, 32)]
    sched.complete(batch)
    batch = sched.schedule()  # a takes the last 4 pages; b cannot grow
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("a", 64, 128)]
    sched.complete(batch)
    # Neither can grow and nothing pinned will free pages: b (younger) is requeued at the head
    # with its computed prefix published, and a continues with the pages b gave back.
    batch = sched.schedule()
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("a", 128, 160)]
    assert b.state is RequestState.WAITING and b.preemptions == 1
    assert sched.waiting[0] is b and not cache.holds("b")
    assert cache.calls("publish", "b") == [("publish", "b", 32)]


def test_abort_from_queue_running_and_pinned():
    sched, cache = _sched(budget=64)
    q, run, pin = make_request("q", 10), make_request("run", 200), make_request("pin", 20)
    sched.add(pin)
    sched.complete(sched.schedule())
    sched.add(run)
    sched.complete(sched.schedule())
    sched.add(q)
    for rid in ("q", "run", "pin"):
        req = sched.abort(rid, "client disconnected")
        assert req.state is RequestState.ABORTED and req.abort_reason == "client disconnected"
        assert not cache.holds(rid)
    assert sched.abort("nobody", "x") is None
    assert not sched.has_work and not sched.pinned and sched.outstanding_tokens() == 0


def test_abort_during_forward_is_ignored_at_completion():
    sched, _ = _sched()
    req = make_request("r", 40)
    sched.add(req)
    batch = sched.schedule()
    sched.abort("r", "gone")
    assert sched.complete(batch) == []
    assert req.state is RequestState.ABORTED


def test_preempt_running_prefill_publishes_computed_prefix():
    sched, cache = _sched(budget=64)
    req = make_request("r", 300)
    sched.add(req)
    sched.complete(sched.schedule())
    assert sched.preempt("r") is req
    assert req.state is RequestState.WAITING and req.preemptions == 1
    assert cache.calls("publish", "r") == [("publish", "r", 64)] and not cache.holds("r")
    sched.add(req)
    chunk = sched.schedule().chunks[0]
    assert chunk.start == 64  # resumes from the published prefix


def test_batch_holds_at_most_max_prefill_requests():
    sched, _ = _sched(budget=1024, max_reqs=2)
    reqs = [make_request(f"r{i}", 20) for i in range(3)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    # Budget for all three, but the forward takes two; the third stays queued in order.
    assert [c.request.rid for c in batch.chunks] == ["r0", "r1"]
    assert list(sched.waiting) == [reqs[2]]
    sched.complete(batch)
    assert [c.request.rid for c in sched.schedule().chunks] == ["r2"]


def test_a_failing_admission_aborts_that_request_and_admits_the_next():
    sched, cache = _sched(budget=128)
    a, b = make_request("a", 40), make_request("b", 30)
    sched.add(a)
    sched.add(b)
    cache.failing.add("a")
    batch = sched.schedule()
    assert [c.request.rid for c in batch.chunks] == ["b"]
    assert a.state is RequestState.ABORTED and "admission failed" in a.abort_reason
    assert "device fault" in a.abort_reason
    assert sched.aborted == [a] and not cache.holds("a") and not sched.waiting
    assert sched.outstanding_tokens() == 30  # a's estimate went with it


def test_a_second_live_request_under_one_id_is_refused_at_add():
    """Before, it was queued: its estimate replaced the first one's (the load undercounted),
    and its admission failed on the cache at the head of the queue at every step, stopping the
    rank."""
    sched, _ = _sched(budget=128)
    sched.add(make_request("x", 10))
    with pytest.raises(ValueError, match="'x' is already queued"):
        sched.add(make_request("x", 12))
    sched.add(make_request("y", 8))
    assert sched.outstanding_tokens() == 10 + 8
    batch = sched.schedule()
    assert [c.request.rid for c in batch.chunks] == ["x", "y"]
    with pytest.raises(ValueError, match="'x' is already queued or running"):
        sched.add(make_request("x", 12))  # running now


@pytest.mark.parametrize("pages", [4, 3])
def test_a_queued_request_that_cannot_fit_on_an_idle_rank_is_aborted(pages):
    """A prompt whose cached prefix alone fills the rank (4 pages: admitted, but no page left
    for its first chunk) or exceeds it (3 pages: acquire finds no room) could never run there.
    Before, schedule() answered None forever with the request at the head of the queue, so it
    and every request behind it waited for good; a prompt that long without a hit is aborted
    (test_lone_prefill_that_cannot_grow_is_aborted_with_reason), and so is this one now."""
    sched, cache = _sched(pages=pages, budget=64)
    keys = [("shared", i) for i in range(4)]
    cache.published.update(keys)  # a 4-page prefix with its checkpoint, cached earlier
    cache.checkpointed.add(keys[-1])
    big = make_request("big", 80, 2)
    big.keys = [*keys, ("big", 4)]
    small = make_request("small", 20)
    sched.add(big)
    sched.add(small)
    batch = sched.schedule()
    assert big.state is RequestState.ABORTED and "more device pages" in big.abort_reason
    assert sched.aborted == [big] and not cache.holds("big") and not sched.waiting
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("small", 0, 20)]
    assert sched.outstanding_tokens() == 20


def test_a_queued_request_waits_while_pinned_results_hold_the_pages():
    """The idle-rank abort above applies only when nothing will free pages: a pinned result
    gives its pages back when its transfer lands, so the queue head waits for it."""
    sched, cache = _sched(pages=4, budget=128)
    pin = make_request("pin", 60)
    sched.add(pin)
    sched.complete(sched.schedule())
    assert pin.state is RequestState.TRANSFERRING and cache.free_pages() == 0
    nxt = make_request("next", 40)
    sched.add(nxt)
    assert sched.schedule() is None and sched.schedule() is None
    assert nxt.state is RequestState.WAITING and not sched.aborted
    sched.release(pin)
    assert [(c.request.rid, c.start, c.end) for c in sched.schedule().chunks] == [("next", 0, 40)]


def test_a_preemption_that_cannot_save_its_state_aborts_the_request():
    """The state snapshot of a preempted prefill fails (a device copy). Before, the request had
    already left `running`: it was then nowhere (not running, not queued, not abortable) while
    the cache still held its pages and slot. Now, as on the decode side, it is released and
    aborted with a reason, left in `aborted` for the caller."""
    sched, cache = _sched(budget=64)
    a = make_request("a", 300)
    sched.add(a)
    sched.complete(sched.schedule())

    def failing(req, length, **kw):
        raise RuntimeError("copy failed")

    cache.checkpoint = failing
    assert sched.preempt("a") is a
    assert a.state is RequestState.ABORTED and "could not save its state" in a.abort_reason
    assert sched.aborted == [a] and not cache.holds("a") and not sched.has_work


def test_a_deadlock_preemption_that_cannot_save_its_state_does_not_requeue_the_victim():
    """Same, inside schedule(): the younger prefill that breaks a page deadlock cannot be
    snapshotted; it is aborted (not requeued), and the older one goes on."""
    sched, cache = _sched(pages=10, budget=96)
    a, b = make_request("a", 200), make_request("b", 200)
    sched.add(a)
    sched.add(b)
    sched.complete(sched.schedule())
    sched.complete(sched.schedule())  # a holds 8 pages, b 2: neither can grow now
    real = cache.checkpoint

    def failing(req, length, **kw):
        if req is b:
            raise RuntimeError("copy failed")
        return real(req, length, **kw)

    cache.checkpoint = failing
    batch = sched.schedule()
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("a", 128, 160)]
    assert b.state is RequestState.ABORTED and sched.aborted == [b]
    assert not sched.waiting and not cache.holds("b")


@pytest.mark.parametrize("cap", [0, 2])
def test_the_deadlock_guard_aborts_a_request_preempted_max_preemptions_times(cap):
    """max_preemptions caps every preemption, the deadlock guard's too. Before, the guard
    requeued the victim whatever its count (a request preempted on decode ranks `cap` times
    already, now re-prefilling): it was preempted once more than the cap allows."""
    sched, cache = _sched(pages=10, budget=96, max_preempt=cap)
    a, b = make_request("a", 200), make_request("b", 200)
    b.preemptions = cap  # preempted `cap` times before (e.g. on decode ranks)
    sched.add(a)
    sched.add(b)
    sched.complete(sched.schedule())
    sched.complete(sched.schedule())  # a holds 8 pages, b 2: neither can grow now
    # As when it is requeued, b (the younger) gives its pages to a; it is aborted instead.
    batch = sched.schedule()
    assert [(c.request.rid, c.start, c.end) for c in batch.chunks] == [("a", 128, 160)]
    assert b.state is RequestState.ABORTED and b.preemptions == cap
    assert b.abort_reason == f"preempted {cap} times without finishing"
    assert sched.aborted == [b] and not sched.waiting and not cache.holds("b")
    assert sched.outstanding_tokens() == 200 - 128  # a's alone (its chunk is in flight)


def test_the_deadlock_guard_requeues_a_request_below_the_cap():
    sched, _ = _sched(pages=10, budget=96, max_preempt=3)
    a, b = make_request("a", 200), make_request("b", 200)
    b.preemptions = 2
    sched.add(a)
    sched.add(b)
    sched.complete(sched.schedule())
    sched.complete(sched.schedule())
    sched.schedule()
    assert b.state is RequestState.WAITING and b.preemptions == 3 and sched.waiting[0] is b
    assert sched.aborted == []


def test_a_preemption_past_the_cap_aborts_the_request():
    """As DecodeScheduler.preempt: a request already preempted max_preemptions times is aborted
    (left in `aborted`) instead of returned to WAITING."""
    sched, cache = _sched(budget=64, max_preempt=1)
    req = make_request("r", 300)
    sched.add(req)
    sched.complete(sched.schedule())
    assert sched.preempt("r") is req and req.state is RequestState.WAITING
    sched.add(req)
    sched.complete(sched.schedule())
    assert sched.preempt("r") is req
    assert req.state is RequestState.ABORTED and req.preemptions == 1
    assert req.abort_reason == "preempted 1 times without finishing"
    assert sched.aborted == [req] and not cache.holds("r") and not sched.has_work
