"""Loaders for workloads written by others: aiperf `dataset.jsonl` and Mooncake traces.

Both are JSON lines with `input_length`, `output_length` and `hash_ids` (one id per 512-token
block; equal ids mean equal content). Rows that carry a `session_id` form multi-turn sessions, in
file order: a session's first row may give `timestamp` (ms) and `group_id`; every later row gives
`delay` (ms after the previous turn's response ended) and covers only the turn's NEW tokens, the
prompt being the conversation so far plus these (aiperf `synthesize agentic-code`
writes exactly this). Rows without a `session_id` are single-turn sessions whose
`hash_ids` describe the whole prompt (the original Mooncake trace).

Blocks are rendered as aiperf renders them: every id is a full block except the last, which holds
the rest of `input_length`; with fewer ids than blocks, the un-hashed tail is unique content.

aiperf datasets are replayed closed-loop (a session starts when a concurrency slot frees; their
timestamps are all 0). Mooncake traces are replayed open-loop: a session starts at its first
row's timestamp, so there the first row of every session (and every single-turn row) must have
one; a session whose first row was malformed starts at the next row that has one.

A malformed line is reported with its line number; `on_error="skip"` keeps going (the issues are
returned with the workload), `on_error="raise"` stops at the first one with a `TraceError`. Lines
are decoded one at a time (a non-UTF-8 byte spoils only its line); a leading UTF-8 byte-order
mark is ignored. Lengths are at most `MAX_TOKENS` and hash ids in [0, 2**63): negative ids are
the simulator's own, for content without an id (outputs, un-hashed tails).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Literal

import attrs

from tokenspeed.workload.model import (
    Session,
    TraceIssue,
    Turn,
    Workload,
    check_block_size,
)

OnError = Literal["skip", "raise"]

# Largest input_length / output_length of one row: 16.8M tokens, 80x the 200k-token contexts of
# agentic workloads and 7x a K3 rank's device tier (longer requests are aborted as too long for
# the cache anyway). A request's page keys are built when it is issued: under 0.5 s at this size.
MAX_TOKENS = 1 << 24
# Page keys pack a block id as a signed 64-bit integer; the negative half is the simulator's.
MAX_HASH_ID = (1 << 63) - 1
_BOM = b"\xef\xbb\xbf"
_MAX_FLOAT = int(sys.float_info.max)


class TraceError(ValueError):
    """A malformed trace line (raised with on_error="raise")."""


@attrs.frozen
class _Row:
    line: int
    session_id: str | None
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    timestamp_ms: float | None
    delay_ms: float | None
    group_id: int | None


def _int_field(
    row: dict, name: str, *, required: bool, minimum: int, maximum: int | None = None
) -> int | None:
    value = row.get(name)
    if value is None:
        if required:
            raise ValueError(f"missing {name!r}")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name!r} must be <= {maximum}, got {value}")
    return value


def _float_field(row: dict, name: str) -> float | None:
    value = row.get(name)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _MAX_FLOAT:
        # JSON integers are unbounded and math.isfinite raises OverflowError past the float
        # range; the digit count keeps the message one short line.
        raise ValueError(
            f"{name!r} must be a finite number, got an integer of {len(str(abs(value)))} digits"
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name!r} must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"{name!r} must be >= 0, got {value}")
    return float(value)


def _parse_row(text: str, line: int, block_size: int) -> _Row:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise ValueError("not valid JSON (nested too deeply)") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    input_length = _int_field(row, "input_length", required=True, minimum=1, maximum=MAX_TOKENS)
    output_length = _int_field(row, "output_length", required=True, minimum=1, maximum=MAX_TOKENS)
    hash_ids = row.get("hash_ids", [])
    if not isinstance(hash_ids, list) or any(
        isinstance(h, bool) or not isinstance(h, int) for h in hash_ids
    ):
        raise ValueError("'hash_ids' must be a list of integers")
    out_of_range = [h for h in hash_ids if not 0 <= h <= MAX_HASH_ID]
    if out_of_range:
        raise ValueError(f"'hash_ids' must be in [0, 2**63), got {out_of_range[0]}")
    if len(hash_ids) > math.ceil(input_length / block_size):
        raise ValueError(
            f"{len(hash_ids)} hash_ids describe more than input_length={input_length} tokens in "
            f"blocks of {block_size}"
        )
    session_id = row.get("session_id")
    # An integer id is accepted (and becomes its decimal string); a bool is not an id.
    if session_id is not None and (
        isinstance(session_id, bool) or not isinstance(session_id, str | int)
    ):
        raise ValueError(f"'session_id' must be a string, got {session_id!r}")
    group_id = _int_field(row, "group_id", required=False, minimum=0)
    return _Row(
        line=line,
        session_id=None if session_id is None else str(session_id),
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(hash_ids),
        timestamp_ms=_float_field(row, "timestamp"),
        delay_ms=_float_field(row, "delay"),
        group_id=group_id,
    )


def _decode(data: bytes, line: int) -> str:
    if line == 1 and data.startswith(_BOM):
        data = data[len(_BOM) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _read_rows(
    path: Path, block_size: int, on_error: OnError, *, timed: bool
) -> tuple[list[_Row], list[TraceIssue]]:
    """timed: replayed at recorded times, so every session's first row needs its timestamp."""
    # Checked before the first row: each row divides by block_size.
    check_block_size(block_size)
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    rows, issues = [], []
    started: set[str] = set()  # sessions that have a valid first row
    with open(path, "rb") as f:
        for line, data in enumerate(f, start=1):
            try:
                text = _decode(data, line)
                if not text.strip():
                    continue
                row = _parse_row(text, line, block_size)
                first = row.session_id is None or row.session_id not in started
                if timed and first and row.timestamp_ms is None:
                    raise ValueError(_missing_timestamp(row))
            except ValueError as exc:
                if on_error == "raise":
                    raise TraceError(f"{path}:{line}: {exc}") from None
                issues.append(TraceIssue(line=line, message=str(exc)))
                continue
            rows.append(row)
            if row.session_id is not None:
                started.add(row.session_id)
    return rows, issues


def _missing_timestamp(row: _Row) -> str:
    if row.session_id is None:
        return "missing 'timestamp' (a timed trace starts each request at its timestamp)"
    return (
        f"missing 'timestamp' on the first valid row of session {row.session_id!r} (a timed "
        "trace starts each session at its timestamp)"
    )


def _turn(row: _Row, first: bool) -> Turn:
    return Turn(
        new_tokens=row.input_length,
        output_tokens=row.output_length,
        blocks=row.hash_ids,
        delay_s=0.0 if first or row.delay_ms is None else row.delay_ms / 1000.0,
    )


def _sessions(rows: list[_Row], *, timed: bool) -> list[Session]:
    grouped: dict[str, list[_Row]] = {}
    singles: list[tuple[int, Session]] = []
    for row in rows:
        if row.session_id is None:
            start = row.timestamp_ms / 1000.0 if timed else None
            session = Session(sid=f"line{row.line}", turns=(_turn(row, True),), start_s=start)
            singles.append((row.line, session))
        else:
            grouped.setdefault(row.session_id, []).append(row)
    sessions = singles + [
        (
            group[0].line,
            Session(
                sid=sid,
                turns=tuple(_turn(r, i == 0) for i, r in enumerate(group)),
                start_s=group[0].timestamp_ms / 1000.0 if timed else None,
                group=group[0].group_id,
            ),
        )
        for sid, group in grouped.items()
    ]
    sessions.sort(key=lambda pair: pair[0])  # file order of each session's first row
    return [s for _, s in sessions]


def _load(
    path: str | Path, block_size: int, on_error: OnError, *, timed: bool, kind: str
) -> Workload:
    """The workload of a trace file; `kind` names its layout in the workload's name."""
    path = Path(path)
    rows, issues = _read_rows(path, block_size, on_error, timed=timed)
    return Workload.of(
        _sessions(rows, timed=timed),
        block_size=block_size,
        name=f"{kind}:{path.name}",
        issues=tuple(issues),
    )


def load_aiperf_dataset(
    path: str | Path, *, block_size: int = 512, on_error: OnError = "skip"
) -> Workload:
    """Sessions from an aiperf `dataset.jsonl`, replayed closed-loop."""
    return _load(path, block_size, on_error, timed=False, kind="aiperf")


def load_mooncake_trace(
    path: str | Path, *, block_size: int = 512, on_error: OnError = "skip"
) -> Workload:
    """Requests (or sessions) from a Mooncake-layout trace, replayed open-loop by timestamp."""
    return _load(path, block_size, on_error, timed=True, kind="mooncake")


def write_aiperf_dataset(sessions: list[Session], path: str | Path) -> Path:
    """Write sessions as an aiperf `dataset.jsonl` (subagents become sessions of their own,
    listed after their parent; the wait for them is not representable there)."""
    path = Path(path)
    flat: list[Session] = []

    def visit(s: Session) -> None:
        flat.append(s)
        for t in s.turns:
            for sub in t.subagents:
                visit(sub)

    for s in sessions:
        visit(s)
    with open(path, "w", encoding="utf-8") as f:
        for s in flat:
            for i, t in enumerate(s.turns):
                row: dict = {
                    "session_id": s.sid,
                    "input_length": t.new_tokens,
                    "output_length": t.output_tokens,
                    "hash_ids": list(t.blocks),
                }
                if i == 0:
                    row["timestamp"] = 0.0 if s.start_s is None else round(s.start_s * 1000, 1)
                    if s.group is not None:
                        row["group_id"] = s.group
                else:
                    row["delay"] = round(t.delay_s * 1000, 1)
                f.write(json.dumps(row) + "\n")
    return path
