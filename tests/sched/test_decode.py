import pytest

from tests.sched.fake_cache import FakeCache, make_request
from tokenspeed.sched.config import SchedulerConfig
from tokenspeed.sched.decode import DecodeScheduler
from tokenspeed.sched.request import RequestState

P = 16


def _sched(
    *, pages=1000, sizes=(1, 2, 4, 8), reserve=0, disaggregated=True, max_preempt=8, on_preempt=None
):
    cache = FakeCache(page_size=P, num_pages=pages)
    cfg = SchedulerConfig(
        page_size=P,
        prefill_token_budget=256,
        checkpoint_interval_pages=4,
        decode_batch_sizes=sizes,
        decode_reserve_pages=reserve,
        max_preemptions=max_preempt,
    )
    sched = DecodeScheduler(
        cfg, cache, disaggregated=disaggregated, save_state_on_preempt=on_preempt
    )
    return sched, cache


def _prefilled(rid, prompt, new, **kw):
    """A request as it leaves a P/D prefill rank: first token sampled, in TRANSFERRING."""
    req = make_request(rid, prompt, new, page_size=P, **kw)
    req.move(RequestState.PREFILLING)
    req.move(RequestState.TRANSFERRING)
    req.num_output = 1
    return req


def _join(sched, *reqs):
    for r in reqs:
        sched.add(r)
    admitted = sched.admit_pending()
    for r in admitted:
        sched.start(r)
    return admitted


def test_admission_reserves_destination_pages_fifo():
    sched, cache = _sched(pages=10)
    a, b, c = _prefilled("a", 64, 4), _prefilled("b", 100, 4), _prefilled("c", 16, 4)
    for r in (a, b, c):
        sched.add(r)
    # a: 5 pages (65 tokens), b: 7 pages -> b does not fit; c must wait behind it (FIFO).
    assert sched.admit_pending() == [a]
    assert cache.pages["a"] == 5 and list(sched.pending) == [b, c]
    assert sched.load().running == 3  # pending requests count toward the rank's load
    assert a.state is RequestState.TRANSFERRING  # admission does not touch the lifecycle


def test_admission_keeps_reserve_headroom():
    sched, _ = _sched(pages=10, reserve=3)
    a = _prefilled("a", 100, 4)  # 7 pages + 3 headroom = 10: fits exactly
    b = _prefilled("b", 16, 4)  # 2 pages + 3 > the 3 left
    sched.add(a)
    sched.add(b)
    assert sched.admit_pending() == [a]


def test_admission_capped_by_largest_graph():
    sched, _ = _sched(sizes=(1, 2))
    reqs = [_prefilled(f"r{i}", 16, 4) for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert sched.admit_pending() == reqs[:2]


def test_start_requires_admission_and_joins_decoding():
    sched, _ = _sched()
    req = _prefilled("r", 40, 4)
    with pytest.raises(KeyError, match="not admitted"):
        sched.start(req)
    _join(sched, req)
    assert req.state is RequestState.DECODING and req.num_computed == 41 - 1


def test_batches_padded_to_graph_sizes():
    sched, _ = _sched(sizes=(1, 2, 4, 8))
    reqs = [_prefilled(f"r{i}", 30, 10) for i in range(5)]
    _join(sched, *reqs)
    batch = sched.schedule()
    assert batch.size == 5 and batch.padded_size == 8
    assert batch.history_lens == (31,) * 5


def test_step_completion_and_finish_publishes_history():
    sched, cache = _sched()
    a, b = _prefilled("a", 40, 3), _prefilled("b", 40, 40)
    _join(sched, a, b)
    batch = sched.schedule()
    assert batch.steps == 1
    assert sched.complete(batch) == []
    assert (a.num_output, a.num_computed) == (2, 41)
    assert sched.complete(sched.schedule()) == [a]
    assert a.state is RequestState.FINISHED and not cache.holds("a")
    assert b.state is RequestState.DECODING
    # a's KV covers 42 tokens; the last full page (32) is not past the prompt's last page (32).
    assert cache.calls("publish", "a") == []
    for _ in range(37):
        done = sched.complete(sched.schedule())
    assert done == [b] and b.num_output == 40
    assert cache.calls("checkpoint", "b") == [("checkpoint", "b", 64)]
    assert cache.calls("publish", "b") == [("publish", "b", 64)]


def test_eos_reported_by_the_engine_finishes_early():
    sched, _ = _sched()
    a, b = _prefilled("a", 40, 50), _prefilled("b", 40, 50)
    _join(sched, a, b)
    assert sched.complete(sched.schedule(), finished={"b"}) == [b]
    assert b.state is RequestState.FINISHED and b.num_output == 2
    assert list(sched.running) == ["a"]


def test_multi_step_batches_stop_at_the_first_finishing_row():
    sched, cache = _sched()
    a, b = _prefilled("a", 40, 6), _prefilled("b", 60, 30)
    _join(sched, a, b)
    batch = sched.schedule(max_steps=100)
    assert batch.steps == 5  # a has 5 tokens left
    assert cache.covered(b) >= b.num_computed + 5  # pages reserved for all steps
    # The caller may stop early (a new request arrived) and resume later.
    assert sched.complete(batch, steps=2) == []
    with pytest.raises(ValueError, match="steps must be in 1..5"):
        sched.complete(batch, steps=6)
    assert sched.complete(sched.schedule(max_steps=100), steps=3) == [a]
    assert b.num_output == 6


def test_a_multi_step_run_reported_step_by_step_checkpoints_from_kept_states():
    """An engine that ran 5 steps before reporting them one by one: a row that ended on a page
    boundary at the first step has a live state 4 steps past it, so with live_state=False its
    turn-end checkpoint is written through save_state, never snapshotted from the live slot."""
    sched, cache = _sched()
    a, b = _prefilled("a", 47, 50), _prefilled("b", 60, 30)  # a's next step ends at 48 = 3 pages
    _join(sched, a, b)
    batch = sched.schedule(max_steps=5)
    assert batch.steps == 5
    saved = []
    done = sched.complete(
        batch,
        finished={"a"},
        live_state=False,
        save_state=lambda r, pos, slot: saved.append((r.rid, pos)),
    )
    assert done == [a] and a.num_computed == 48
    assert cache.kinds[-1] == ("a", 48, True, False)  # not from the live slot
    assert saved == [("a", 48)]
    for _ in range(4):  # the run's other steps, a already gone
        assert sched.complete(batch, live_state=False) == []
    assert b.num_output == 6
    # Reported as it runs (the default), the same boundary is snapshotted from the live slot.
    sched, cache = _sched()
    a = _prefilled("a", 47, 50)
    _join(sched, a)
    assert sched.complete(sched.schedule(), finished={"a"}) == [a]
    assert cache.kinds[-1] == ("a", 48, True, True)


def test_out_of_pages_preempts_the_youngest_row():
    sched, cache = _sched(pages=7)
    a, b = _prefilled("a", 47, 30), _prefilled("b", 47, 30)
    _join(sched, a, b)  # 3 pages each; 1 free
    assert cache.free_pages() == 1
    batch = sched.schedule()  # both at 47 tokens: the step writes token 48 -> fits page 3
    sched.complete(batch)
    batch = sched.schedule()  # both need a 4th page; only one is free
    assert [r.rid for r in batch.requests] == ["a"]
    assert b.state is RequestState.WAITING and b.preemptions == 1
    assert sched.preempted == [b] and not cache.holds("b")
    # b's history up to its last full page was published for its re-prefill.
    assert cache.calls("publish", "b") == [("publish", "b", 48)]
    assert b.prefill_target == 47 + 2  # prompt plus the two tokens it generated


def test_request_preempted_too_often_is_aborted():
    sched, _ = _sched(pages=7, max_preempt=0)
    a, b = _prefilled("a", 47, 30), _prefilled("b", 47, 30)
    _join(sched, a, b)
    sched.complete(sched.schedule())
    sched.schedule()
    assert b.state is RequestState.ABORTED and "preempted 0 times" in b.abort_reason
    assert sched.aborted == [b] and sched.preempted == []


def test_lone_row_that_outgrows_the_rank_is_aborted():
    sched, cache = _sched(pages=3)
    a = _prefilled("a", 47, 30)
    _join(sched, a)
    sched.complete(sched.schedule())
    assert sched.schedule() is None
    assert a.state is RequestState.ABORTED and "outgrew" in a.abort_reason
    assert not cache.holds("a")


def test_abort_pending_admitted_and_running():
    sched, cache = _sched(pages=12)
    run, adm, pend = _prefilled("run", 40, 9), _prefilled("adm", 40, 9), _prefilled("pend", 200, 9)
    _join(sched, run)
    sched.add(adm)
    sched.add(pend)
    assert sched.admit_pending() == [adm]
    # Still in their prefill stage: only the decode-side reservation goes.
    assert sched.abort("pend", "x") is pend and pend.state is RequestState.TRANSFERRING
    assert sched.abort("adm", "x") is adm and not cache.holds("adm")
    assert sched.abort("run", "client gone") is run
    assert run.state is RequestState.ABORTED and not cache.holds("run")
    assert sched.load().running == 0 and cache.used_pages == 0


def test_aggregated_decode_rejects_pd_admission():
    sched, _ = _sched(disaggregated=False)
    with pytest.raises(RuntimeError, match="P/D"):
        sched.add(_prefilled("r", 16, 2))


def test_a_failing_state_copy_at_a_finish_leaves_the_row_to_abort():
    """save_state raises for a finishing row that needs its turn end copied: the row stays
    running (not half removed), so an abort frees its cache."""
    sched, cache = _sched()
    a = _prefilled("a", 47, 50)
    _join(sched, a)
    batch = sched.schedule(max_steps=5)

    def failing(req, pos, slot):
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        sched.complete(batch, finished={"a"}, live_state=False, save_state=failing)
    assert "a" in sched.running and cache.holds("a")
    assert sched.abort("a", "step failed") is a and not cache.holds("a")
    assert a.state is RequestState.ABORTED


def test_a_preemption_that_cannot_save_its_state_aborts_the_victim():
    def failing(req, pos, slot):
        raise RuntimeError("copy failed")

    sched, cache = _sched(on_preempt=failing)
    a, b = _prefilled("a", 40, 30), _prefilled("b", 40, 30)
    _join(sched, a, b)
    for _ in range(9):  # 49 tokens computed: the last full page ends at 48, behind the live state
        sched.complete(sched.schedule())
    assert sched.preempt("b") is b
    assert b.state is RequestState.ABORTED and "could not save its state" in b.abort_reason
    assert sched.aborted == [b] and sched.preempted == [] and not cache.holds("b")
    assert [r.rid for r in sched.schedule().requests] == ["a"]


def test_a_failing_admission_aborts_that_request_and_admits_the_next():
    sched, cache = _sched(pages=20)
    a, b = _prefilled("a", 40, 4), _prefilled("b", 40, 4)
    sched.add(a)
    sched.add(b)
    cache.failing.add("a")
    assert sched.admit_pending() == [b]
    assert a.state is RequestState.ABORTED and "admission failed" in a.abort_reason
    assert sched.aborted == [a] and not sched.pending and not cache.holds("a")


def test_a_second_live_request_under_one_id_is_refused_at_add():
    """Before, the duplicate's admission failed on the cache at the head of the queue at every
    call, and nothing behind it was ever admitted."""
    sched, _ = _sched(pages=100)
    sched.add(_prefilled("z", 16, 4))
    with pytest.raises(ValueError, match="'z' is already queued"):
        sched.add(_prefilled("z", 20, 4))
    sched.add(_prefilled("w", 16, 4))
    assert [r.rid for r in sched.admit_pending()] == ["z", "w"]
    with pytest.raises(ValueError, match="'z' is already queued or running"):
        sched.add(_prefilled("z", 20, 4))  # admitted now


def test_start_of_a_request_that_ended_meanwhile_keeps_its_reservation_for_abort():
    """The request was aborted on its prefill rank while its transfer ran. Before, start()
    dropped it from `admitted` and then raised LifecycleError: its destination pages were held
    by no one, and abort() on this rank found nothing to free."""
    from tokenspeed.sched.request import LifecycleError

    sched, cache = _sched()
    r = _prefilled("r", 40, 5)
    sched.add(r)
    assert sched.admit_pending() == [r]
    r.abort("client gone")
    with pytest.raises(LifecycleError):
        sched.start(r)
    assert sched.abort("r", "client gone") is r
    assert not cache.holds("r") and cache.used_pages == 0 and not sched.running


@pytest.mark.parametrize("eos", [False, True])
def test_a_stale_row_does_not_touch_a_new_request_under_the_same_id(eos):
    """The old request was aborted while its step ran, and a new request under the same id was
    added and started before the step completed. Before, complete() recognised stale rows by id:
    the old row (its last token due, or an EOS named by id) published and released the new
    request's cache, dropped it from `running`, and raised moving the aborted request to
    FINISHED."""
    sched, cache = _sched()
    old = _prefilled("x", 40, 2 if not eos else 9)
    _join(sched, old)
    batch = sched.schedule()
    assert batch.requests == (old,)
    assert sched.abort("x", "client gone") is old  # mid-step
    new = _prefilled("x", 50, 6, content="new")
    _join(sched, new)
    held, computed = cache.pages["x"], new.num_computed
    log_len = len(cache.log)

    assert sched.complete(batch, finished={"x"} if eos else ()) == []

    assert old.state is RequestState.ABORTED and old.num_output == 1
    assert len(cache.calls("release", "x")) == 1  # the abort's: the old one is released once
    assert cache.log[log_len:] == []  # no checkpoint, publish or release for the stale row
    assert sched.running == {"x": new} and new.state is RequestState.DECODING
    assert new.num_output == 1 and new.num_computed == computed and cache.pages["x"] == held
    # The new request decodes on as if the old batch had never been reported.
    for _ in range(5):
        done = sched.complete(sched.schedule())
    assert done == [new] and new.state is RequestState.FINISHED and new.num_output == 6
    assert not cache.holds("x") and len(cache.calls("release", "x")) == 2
