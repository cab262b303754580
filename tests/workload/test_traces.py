import itertools
import json
import math

import pytest

from tokenspeed.cache.keys import key_at, keys_equal
from tokenspeed.sim.cluster.sessions import Conversation, PrefixChains
from tokenspeed.workload import (
    AgentXConfig,
    AgentXWorkload,
    Session,
    TraceError,
    Turn,
    Workload,
    load_aiperf_dataset,
    load_mooncake_trace,
    write_aiperf_dataset,
)
from tokenspeed.workload.traces import MAX_TOKENS

# The layout `aiperf synthesize agentic-code` writes: a session's first row
# has timestamp and group_id and the whole initial context; later rows have delay (ms after the
# previous answer) and only the turn's new tokens.
AIPERF_ROWS = [
    {
        "session_id": "sess-a",
        "input_length": 1300,
        "output_length": 40,
        "hash_ids": [0, 1, 7],
        "timestamp": 0.0,
        "group_id": 3,
    },
    {
        "session_id": "sess-b",
        "input_length": 1100,
        "output_length": 20,
        "hash_ids": [0, 1, 9],
        "timestamp": 0.0,
        "group_id": 1,
    },
    {
        "session_id": "sess-a",
        "input_length": 600,
        "output_length": 30,
        "hash_ids": [100, 101],
        "delay": 2500.0,
    },
    {
        "session_id": "sess-a",
        "input_length": 200,
        "output_length": 10,
        "hash_ids": [102],
        "delay": 41000.0,
    },
]


def _write(tmp_path, rows, name="dataset.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_aiperf_dataset_becomes_sessions(tmp_path):
    w = load_aiperf_dataset(_write(tmp_path, AIPERF_ROWS))
    assert not w.issues and not w.timed and w.block_size == 512
    a, b = w.sessions
    assert (a.sid, b.sid) == ("sess-a", "sess-b") and a.group == 3
    assert [t.new_tokens for t in a.turns] == [1300, 600, 200]
    assert [t.output_tokens for t in a.turns] == [40, 30, 10]
    assert [t.delay_s for t in a.turns] == [0.0, 2.5, 41.0]
    assert a.turns[1].blocks == (100, 101)
    # Shared hash ids are the shared prefix.
    assert a.turns[0].blocks[:2] == b.turns[0].blocks[:2]


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(tmp_path):
    rows = [
        AIPERF_ROWS[0],
        "{not json",
        {"session_id": "x", "output_length": 5},
        {"session_id": "x", "input_length": 10, "output_length": 5, "hash_ids": [1, 2]},
        {"session_id": "x", "input_length": -3, "output_length": 5},
        {"session_id": "x", "input_length": 10, "output_length": 5, "delay": "soon"},
        "[1, 2]",
        "",
        AIPERF_ROWS[2],
    ]
    w = load_aiperf_dataset(_write(tmp_path, rows))
    assert [(i.line, i.message.split(" (")[0]) for i in w.issues] == [
        (2, "not valid JSON"),
        (3, "missing 'input_length'"),
        (4, "2 hash_ids describe more than input_length=10 tokens in blocks of 512"),
        (5, "'input_length' must be >= 1, got -3"),
        (6, "'delay' must be a finite number, got 'soon'"),
        (7, "expected a JSON object, got list"),
    ]
    assert str(w.issues[0]).startswith("line 2: not valid JSON")
    (a,) = w.sessions
    assert [t.new_tokens for t in a.turns] == [1300, 600]


def test_malformed_line_rejected_by_flag(tmp_path):
    path = _write(tmp_path, [AIPERF_ROWS[0], AIPERF_ROWS[2], '{"input_length": 5}'])
    with pytest.raises(TraceError, match=r"dataset.jsonl:3: missing 'output_length'"):
        load_aiperf_dataset(path, on_error="raise")
    with pytest.raises(ValueError, match="on_error"):
        load_aiperf_dataset(path, on_error="ignore")


def test_mooncake_trace_is_timed_single_turn(tmp_path):
    rows = [
        {
            "timestamp": 27482,
            "input_length": 6955,
            "output_length": 52,
            "hash_ids": list(range(14)),
        },
        {
            "timestamp": 30535,
            "input_length": 6472,
            "output_length": 26,
            "hash_ids": [*range(12), 46, 47, 48][:13],
        },
    ]
    w = load_mooncake_trace(_write(tmp_path, rows, "trace.jsonl"))
    assert w.timed
    assert [s.start_s for s in w.sessions] == [27.482, 30.535]
    assert all(len(s.turns) == 1 for s in w.sessions)
    # Full-prompt hash ids: the two requests share their first 12 blocks.
    assert w.sessions[0].turns[0].blocks[:12] == w.sessions[1].turns[0].blocks[:12]


def test_generated_workload_round_trips_through_aiperf_format(tmp_path):
    gen = AgentXWorkload(AgentXConfig(subagent_probability=0.0, max_turns=6), seed=4)
    sessions = list(gen.take(5))
    path = write_aiperf_dataset(sessions, tmp_path / "dataset.jsonl")
    back = load_aiperf_dataset(path)
    assert not back.issues
    assert [(s.sid, s.group) for s in back] == [(s.sid, s.group) for s in sessions]
    for s, b in zip(sessions, back, strict=True):
        assert [(t.new_tokens, t.output_tokens, t.blocks) for t in s.turns] == [
            (t.new_tokens, t.output_tokens, t.blocks) for t in b.turns
        ]
        # Delays are written in ms with one decimal, as aiperf writes them.
        assert [t.delay_s for t in b.turns] == pytest.approx([t.delay_s for t in s.turns], abs=1e-4)


def test_aiperf_turns_replay_as_growing_prompts_with_outputs_in_the_history(tmp_path):
    """A later aiperf row holds only its turn's new tokens: the request the simulator issues has
    the whole conversation so far as its prompt (earlier inputs AND the outputs generated for
    them), and its page keys extend the previous turn's; equal hash ids across sessions give
    equal keys (the shared prefix)."""
    w = load_aiperf_dataset(_write(tmp_path, AIPERF_ROWS))
    a, b = w.sessions
    prefixes, ids = PrefixChains(64, 512), itertools.count(1)
    conv = Conversation(a)
    reqs = []
    for _ in a.turns:
        reqs.append(conv.next_request(len(reqs), prefixes, ids))
        conv.index += 1
    assert [r.prompt_len for r in reqs] == [1300, 1300 + 40 + 600, 1300 + 40 + 600 + 30 + 200]
    assert [r.max_new_tokens for r in reqs] == [40, 30, 10]
    for prev, cur in itertools.pairwise(reqs):
        # Keys of the previous prompt and output are a prefix of this turn's keys.
        assert keys_equal(cur.keys[: len(prev.keys)], prev.keys)
    first_b = Conversation(b).next_request(99, prefixes, ids)
    # Hash ids [0, 1] shared: 1024 tokens = 16 pages of 64 with identical keys; then they differ.
    assert keys_equal(first_b.keys[:16], reqs[0].keys[:16])
    assert key_at(first_b.keys, 16) != key_at(reqs[0].keys, 16)


def _mooncake(timestamp=None, **fields):
    row = {"input_length": 600, "output_length": 5, "hash_ids": [1, 2], **fields}
    if timestamp is not None:
        row["timestamp"] = timestamp
    return row


def test_timed_trace_rows_without_their_start_time_are_malformed(tmp_path):
    """A Mooncake row or session with no timestamp would never be replayed: it is reported, not
    dropped in silence, and a session whose first row was skipped starts at its first valid row
    that has a timestamp (never at t=0)."""
    rows = [
        _mooncake(1000),
        _mooncake(),  # a single-turn row without a start time
        _mooncake(600_000, session_id="s", input_length=-5),  # malformed first row of "s"
        _mooncake(session_id="s", delay=1000),  # now the first valid row: needs a timestamp
        _mooncake(700_000, session_id="s"),  # the first valid row with one: "s" starts here
        _mooncake(session_id="s", delay=2000),
    ]
    path = _write(tmp_path, rows, "trace.jsonl")
    w = load_mooncake_trace(path)
    assert [(i.line, i.message.split(" (")[0]) for i in w.issues] == [
        (2, "missing 'timestamp'"),
        (3, "'input_length' must be >= 1, got -5"),
        (4, "missing 'timestamp' on the first valid row of session 's'"),
    ]
    assert [(s.sid, s.start_s, len(s.turns)) for s in w.sessions] == [
        ("line1", 1.0, 1),
        ("s", 700.0, 2),
    ]
    with pytest.raises(TraceError, match=r"trace.jsonl:2: missing 'timestamp'"):
        load_mooncake_trace(path, on_error="raise")
    # Replayed closed-loop, an aiperf dataset needs no timestamps.
    assert not load_aiperf_dataset(_write(tmp_path, [_mooncake(session_id="a")])).issues


def test_a_workload_is_timed_throughout_or_not_at_all():
    timed = Session(sid="a", turns=(Turn(new_tokens=5, output_tokens=1),), start_s=1.0)
    untimed = Session(sid="b", turns=(Turn(new_tokens=5, output_tokens=1),))
    with pytest.raises(ValueError, match="1 of 2 lack it"):
        Workload.of([timed, untimed])


@pytest.mark.parametrize(
    ("hash_ids", "message"),
    [
        # Negative ids are the simulator's own for content without an id (outputs).
        ([5, -1], "'hash_ids' must be in [0, 2**63), got -1"),
        # Page keys pack a block id as a signed 64-bit integer.
        ([1, 2**63], f"'hash_ids' must be in [0, 2**63), got {2**63}"),
    ],
)
def test_hash_ids_outside_the_trace_range_are_malformed(tmp_path, hash_ids, message):
    rows = [AIPERF_ROWS[0], {**AIPERF_ROWS[1], "hash_ids": hash_ids}]
    w = load_aiperf_dataset(_write(tmp_path, rows))
    assert [(i.line, i.message) for i in w.issues] == [(2, message)]
    assert [s.sid for s in w.sessions] == ["sess-a"]
    ok = load_aiperf_dataset(_write(tmp_path, [{**AIPERF_ROWS[1], "hash_ids": [0, 2**63 - 1]}]))
    assert not ok.issues


def test_lengths_past_the_documented_bound_are_malformed(tmp_path):
    rows = [
        {**AIPERF_ROWS[0], "input_length": MAX_TOKENS + 1},
        {**AIPERF_ROWS[0], "output_length": 10**30},
        {**AIPERF_ROWS[0], "input_length": MAX_TOKENS, "output_length": MAX_TOKENS},
    ]
    w = load_aiperf_dataset(_write(tmp_path, rows))
    assert [(i.line, i.message) for i in w.issues] == [
        (1, f"'input_length' must be <= {MAX_TOKENS}, got {MAX_TOKENS + 1}"),
        (2, f"'output_length' must be <= {MAX_TOKENS}, got {10**30}"),
    ]
    assert [t.new_tokens for s in w.sessions for t in s.turns] == [MAX_TOKENS]


def test_a_non_utf8_byte_spoils_only_its_line_and_a_bom_is_ignored(tmp_path):
    ok = json.dumps(AIPERF_ROWS[0]).encode()
    path = tmp_path / "dataset.jsonl"
    path.write_bytes(ok + b"\n" + b'{"session_id": "b", "input_length": 6\xff}\n' + ok + b"\n")
    w = load_aiperf_dataset(path)
    assert [(i.line, i.message) for i in w.issues] == [
        (2, "not valid UTF-8 (invalid start byte at byte 37)")
    ]
    assert [len(s.turns) for s in w.sessions] == [2]
    with pytest.raises(TraceError, match=r"dataset.jsonl:2: not valid UTF-8"):
        load_aiperf_dataset(path, on_error="raise")
    path.write_bytes(b"\xef\xbb\xbf" + ok + b"\r\n")
    w = load_aiperf_dataset(path)
    assert not w.issues and [s.sid for s in w.sessions] == ["sess-a"]


@pytest.mark.parametrize("field", ["timestamp", "delay"])
def test_integer_times_too_large_for_a_float_are_malformed(tmp_path, field):
    """JSON integers are unbounded: one past the float range used to escape the loader as an
    OverflowError (a crash even with on_error="skip") instead of a reported line."""
    rows = [AIPERF_ROWS[0], {**AIPERF_ROWS[2], field: 10**400}, AIPERF_ROWS[3]]
    path = _write(tmp_path, rows)
    w = load_aiperf_dataset(path)
    assert [(i.line, i.message) for i in w.issues] == [
        (2, f"'{field}' must be a finite number, got an integer of 401 digits")
    ]
    assert [len(s.turns) for s in w.sessions] == [2]
    with pytest.raises(TraceError, match=rf"dataset.jsonl:2: '{field}' must be a finite number"):
        load_aiperf_dataset(path, on_error="raise")


def test_json_nested_too_deeply_is_malformed(tmp_path):
    """The JSON decoder recurses per nesting level: a pathological line used to escape as a
    RecursionError instead of a reported line."""
    deep = '{"input_length": 10, "output_length": 5, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = _write(tmp_path, [AIPERF_ROWS[0], deep, AIPERF_ROWS[2]])
    w = load_aiperf_dataset(path)
    assert [(i.line, i.message) for i in w.issues] == [(2, "not valid JSON (nested too deeply)")]
    assert [len(s.turns) for s in w.sessions] == [2]
    with pytest.raises(TraceError, match="dataset.jsonl:2: not valid JSON"):
        load_mooncake_trace(path, on_error="raise")


def test_a_boolean_session_id_is_malformed(tmp_path):
    # `true` is not an id: it used to become the session "True" (merging with a real "True").
    path = _write(tmp_path, [{**AIPERF_ROWS[0], "session_id": True}, AIPERF_ROWS[1]])
    w = load_aiperf_dataset(path)
    assert [(i.line, i.message) for i in w.issues] == [
        (1, "'session_id' must be a string, got True")
    ]
    assert [s.sid for s in w.sessions] == ["sess-b"]


@pytest.mark.parametrize("block_size", [0, -512, 1.5, True])
def test_loaders_and_workloads_reject_a_block_size_that_is_not_a_positive_integer(
    tmp_path, block_size
):
    """block_size=0 used to fail per row with a ZeroDivisionError (a crash, not a message)."""
    path = _write(tmp_path, AIPERF_ROWS)
    for loader in (load_aiperf_dataset, load_mooncake_trace):
        with pytest.raises(ValueError, match="block_size must be a positive integer"):
            loader(path, block_size=block_size)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        Workload.of([], block_size=block_size)


@pytest.mark.parametrize("start", [-1.0, math.nan, math.inf, True, "0"])
def test_a_session_start_must_be_a_finite_non_negative_time(start):
    """A timed session is pushed on the event heap at start_s: a NaN breaks the heap order and
    a negative time runs the clock backwards, silently."""
    with pytest.raises(ValueError, match="start_s must be finite and >= 0"):
        Session(sid="a", turns=(Turn(new_tokens=5, output_tokens=1),), start_s=start)
    assert Session(sid="a", turns=(Turn(new_tokens=5, output_tokens=1),), start_s=0).start_s == 0
