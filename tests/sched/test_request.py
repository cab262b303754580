import itertools

import pytest

from tokenspeed.sched.request import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATES,
    LifecycleError,
    Request,
    RequestState,
)

S = RequestState
EXPECTED = {
    (S.WAITING, S.PREFILLING),
    (S.WAITING, S.ABORTED),
    (S.PREFILLING, S.TRANSFERRING),
    (S.PREFILLING, S.DECODING),
    (S.PREFILLING, S.FINISHED),
    (S.PREFILLING, S.WAITING),
    (S.PREFILLING, S.ABORTED),
    (S.TRANSFERRING, S.DECODING),
    (S.TRANSFERRING, S.WAITING),
    (S.TRANSFERRING, S.ABORTED),
    (S.DECODING, S.FINISHED),
    (S.DECODING, S.WAITING),
    (S.DECODING, S.ABORTED),
}


def _at(state: RequestState) -> Request:
    req = Request("r", 100, 8)
    req.state = state
    return req


def test_transition_table_is_the_documented_diagram():
    table = {(a, b) for a, targets in ALLOWED_TRANSITIONS.items() for b in targets}
    assert table == EXPECTED
    assert all(not ALLOWED_TRANSITIONS[s] for s in TERMINAL_STATES)


@pytest.mark.parametrize(("src", "dst"), sorted(EXPECTED, key=lambda p: (p[0].value, p[1].value)))
def test_allowed_transition(src, dst):
    req = _at(src)
    req.move(dst)
    assert req.state is dst


@pytest.mark.parametrize(
    ("src", "dst"),
    [p for p in itertools.product(S, S) if p not in EXPECTED],
)
def test_forbidden_transition_raises_and_keeps_state(src, dst):
    req = _at(src)
    with pytest.raises(LifecycleError, match=f"{src.value} -> {dst.value}"):
        req.move(dst)
    assert req.state is src


def test_preempt_requeues_with_output_kept():
    req = _at(S.DECODING)
    req.num_output = 5
    req.num_computed = 104
    req.num_cached = 64
    req.preempt()
    assert req.state is S.WAITING
    assert req.preemptions == 1
    assert (req.num_computed, req.num_cached) == (0, 0)
    # Generated tokens stay: the re-prefill covers prompt plus output so far.
    assert req.prefill_target == 105
    assert req.output_remaining == 3


def test_abort_records_reason_and_is_terminal():
    req = _at(S.PREFILLING)
    req.abort("client went away")
    assert req.state is S.ABORTED and req.abort_reason == "client went away"
    assert req.done
    with pytest.raises(LifecycleError):
        req.abort("again")


@pytest.mark.parametrize(("prompt", "new"), [(0, 1), (5, 0), (-1, 3)])
def test_request_rejects_empty_prompt_or_output(prompt, new):
    with pytest.raises(ValueError, match="must be positive"):
        Request("bad", prompt, new)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_len", 10.5),
        ("prompt_len", 10.0),
        ("prompt_len", "10"),
        ("prompt_len", None),
        ("prompt_len", True),
        ("max_new_tokens", 2.5),
        ("max_new_tokens", True),
        ("max_new_tokens", "4"),
    ],
)
def test_request_lengths_must_be_integers(field, value):
    lengths = {"prompt_len": 10, "max_new_tokens": 4, field: value}
    with pytest.raises(ValueError, match=f"request 'bad': {field} must be an integer, got"):
        Request("bad", **lengths)


@pytest.mark.parametrize("field", ["num_computed", "num_cached", "num_output", "preemptions"])
@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_request_counters_must_be_non_negative_integers(field, value):
    with pytest.raises(ValueError, match=f"request 'bad': {field} must be"):
        Request("bad", 10, 4, **{field: value})


@pytest.mark.parametrize("field", ["prefill_rank", "decode_rank"])
@pytest.mark.parametrize("value", [-1, 0.0, False, "0"])
def test_request_ranks_must_be_non_negative_integers_or_none(field, value):
    with pytest.raises(ValueError, match=f"request 'bad': {field} must be"):
        Request("bad", 10, 4, **{field: value})


def test_request_state_and_abort_reason_types():
    with pytest.raises(ValueError, match="state must be a RequestState"):
        Request("bad", 10, 4, state="waiting")
    with pytest.raises(ValueError, match="abort_reason must be a string or None"):
        Request("bad", 10, 4, abort_reason=1)


def test_request_id_must_be_hashable():
    with pytest.raises(ValueError, match=r"request id must be hashable, got \['a'\]"):
        Request(["a"], 10, 4)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_output": 5}, r"num_output \(5\) exceeds max_new_tokens \(4\)"),
        ({"num_computed": 11}, r"num_computed \(11\) exceeds the sequence"),
        ({"num_computed": 3, "num_cached": 4}, r"num_cached \(4\) exceeds num_computed \(3\)"),
    ],
)
def test_request_counters_must_be_consistent(kw, message):
    with pytest.raises(ValueError, match=message):
        Request("bad", 10, 4, **kw)


def test_request_accepts_valid_fields():
    req = Request(
        ("s", 3),
        10,
        4,
        num_computed=12,
        num_cached=8,
        num_output=2,
        preemptions=1,
        prefill_rank=0,
        decode_rank=3,
        state=RequestState.DECODING,
    )
    assert (req.seq_len, req.prefill_remaining, req.output_remaining) == (12, 0, 2)


@pytest.mark.parametrize("reason", [None, "", 3])
def test_abort_needs_a_reason(reason):
    """Aborts always carry a reason (callers report it); before, abort(None) ended the request
    with none."""
    req = Request("r", 10, 4)
    with pytest.raises(ValueError, match="abort reason must be a non-empty string"):
        req.abort(reason)
    assert req.state is RequestState.WAITING and req.abort_reason is None


def test_request_session_must_be_hashable():
    """The router keys conversation affinity by session; an unhashable one failed there, at
    routing, with a TypeError naming no request."""
    with pytest.raises(ValueError, match=r"request 'r': session must be hashable, got \['c'\]"):
        Request("r", 10, 4, session=["c"])
