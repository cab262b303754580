"""Every lifecycle transition, driven through the schedulers the way an engine drives them."""

from tests.sched.fake_cache import FakeCache, make_request
from tokenspeed.sched.config import SchedulerConfig
from tokenspeed.sched.decode import DecodeScheduler
from tokenspeed.sched.prefill import PrefillScheduler
from tokenspeed.sched.request import RequestState

S = RequestState
P = 16


def _pd(pages=1000):
    cfg = SchedulerConfig(
        page_size=P,
        prefill_token_budget=256,
        checkpoint_interval_pages=4,
        decode_batch_sizes=(1, 2, 4),
    )
    pc, dc = FakeCache(page_size=P, num_pages=pages), FakeCache(page_size=P, num_pages=pages)
    return (
        PrefillScheduler(cfg, pc, disaggregated=True),
        DecodeScheduler(cfg, dc, disaggregated=True),
        pc,
        dc,
    )


def test_full_pd_path_visits_every_live_state():
    pre, dec, pc, dc = _pd()
    req = make_request("r", 50, 3)
    seen = [req.state]
    pre.add(req)
    dec.add(req)  # independent admission: decode side queued at once
    batch = pre.schedule()
    seen.append(req.state)
    assert dec.admit_pending() == [req]
    pre.complete(batch)
    seen.append(req.state)
    dec.start(req)  # transfer landed
    pre.release(req)
    seen.append(req.state)
    while not req.done:
        dec.complete(dec.schedule())
    seen.append(req.state)
    assert seen == [S.WAITING, S.PREFILLING, S.TRANSFERRING, S.DECODING, S.FINISHED]
    assert req.num_output == 3
    assert pc.used_pages == 0 and dc.used_pages == 0


def test_waiting_to_aborted():
    pre, _, _, _ = _pd()
    req = make_request("r", 50)
    pre.add(req)
    pre.abort("r", "x")
    assert req.state is S.ABORTED


def test_prefilling_to_waiting_and_back_through_preemption():
    pre, _, pc, _ = _pd()
    req = make_request("r", 600)
    pre.add(req)
    pre.complete(pre.schedule())
    pre.preempt("r")
    assert req.state is S.WAITING and not pc.holds("r")
    pre.add(req)
    pre.schedule()
    assert req.state is S.PREFILLING and req.num_cached == 256


def test_transferring_to_waiting_and_to_aborted():
    pre, _, pc, _ = _pd()
    a, b = make_request("a", 40), make_request("b", 40)
    pre.add(a)
    pre.add(b)
    pre.complete(pre.schedule())
    assert a.state is b.state is S.TRANSFERRING
    pre.preempt("a")
    assert a.state is S.WAITING and not pc.holds("a")
    pre.abort("b", "decode rank lost")
    assert b.state is S.ABORTED and not pc.holds("b")


def test_decoding_to_waiting_and_to_aborted():
    pre, dec, _, dc = _pd()
    a, b = make_request("a", 40, 9), make_request("b", 40, 9)
    for r in (a, b):
        pre.add(r)
        dec.add(r)
    pre.complete(pre.schedule())
    for r in dec.admit_pending():
        dec.start(r)
        pre.release(r)
    dec.preempt("a")
    assert a.state is S.WAITING and dec.preempted == [a] and not dc.holds("a")
    dec.abort("b", "client gone")
    assert b.state is S.ABORTED and not dc.holds("b")


def test_decode_preemption_requeues_and_the_request_still_finishes():
    """Preempted while decoding -> WAITING with its history published -> routed again: the
    re-prefill covers prompt plus the tokens generated so far, reuses the published prefix, and
    decoding resumes to exactly max_new_tokens."""
    pre, dec, pc, dc = _pd()
    req = make_request("r", 40, 30)
    pre.add(req)
    dec.add(req)
    pre.complete(pre.schedule())
    dec.admit_pending()
    dec.start(req)
    pre.release(req)
    for _ in range(12):  # 13 tokens out: KV covers 40 + 12 = 52 tokens, 3 full pages
        dec.complete(dec.schedule())
    assert req.num_output == 13
    assert dec.preempt("r") is req
    assert req.state is S.WAITING and req.preemptions == 1 and dec.preempted == [req]
    assert dc.calls("publish", "r")[-1] == ("publish", "r", 48)
    assert dc.used_pages == 0
    # The caller routes it again; the prefill rank sees the decode rank's published history
    # (a shared L2 in the real cache; the fake caches share their index for that here).
    dec.preempted.clear()
    pc.published |= dc.published
    pc.checkpointed |= dc.checkpointed
    pre.add(req)
    dec.add(req)
    batch = pre.schedule()
    assert req.state is S.PREFILLING and req.prefill_target == 40 + 13
    assert [(c.start, c.end) for c in batch.chunks] == [(48, 53)]  # only the unpublished tail
    pre.complete(batch)
    assert req.state is S.TRANSFERRING and req.num_output == 14
    dec.admit_pending()
    dec.start(req)
    pre.release(req)
    while not req.done:
        dec.complete(dec.schedule())
    assert req.state is S.FINISHED and req.num_output == 30
    assert pc.used_pages == 0 and dc.used_pages == 0
