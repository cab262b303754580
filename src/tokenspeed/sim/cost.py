"""How long a forward takes: the simulator's only notion of hardware.

A cost model answers four questions, all in seconds:
- `prefill_time(spans)`: one prefill forward computing token ranges [start, end) of several
  requests (start = tokens already cached, which each new token attends to);
- `decode_step_time(rows, padded_rows, history)`: one decode step of `rows` real rows run at graph
  size `padded_rows`, attending to `history` cached tokens in total;
- `transfer_time(nbytes)`: moving a request's KV pages and KDA state from a prefill rank to a
  decode rank;
- `load_time(nbytes)`: copying an L2 hit into the device tier (overlapped with the forward, so
  the simulator charges max(compute, load)).

`LinearCostModel` is the stated default (see docs/sim.md for its numbers and where they come
from); `TableCostModel` replaces it with a table measured on a GPU (JSON, same four questions).
`SpeculativeCostModel` wraps either for speculative decoding: every decode step is a verify step
of k + 1 positions per row that emits A tokens per row on average (the acceptance length).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import attrs


class CostModel(Protocol):
    def prefill_time(self, spans: Sequence[tuple[int, int]]) -> float: ...

    def decode_step_time(self, rows: int, padded_rows: int, history: int) -> float: ...

    def transfer_time(self, nbytes: int) -> float: ...

    def load_time(self, nbytes: int) -> float: ...


class ArithmeticEnds(Sequence[float]):
    """The cumulative end offsets of a run of decode steps whose step i costs
    `first + growth * i`, computed when asked (a run is up to hundreds of steps and most are
    never looked at): element k - 1 is `k * first + growth * k * (k - 1) / 2`."""

    __slots__ = ("first", "growth", "steps")

    def __init__(self, first: float, growth: float, steps: int) -> None:
        self.first, self.growth, self.steps = first, growth, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> float:  # type: ignore[override]
        if i < 0:
            i += self.steps
        if not 0 <= i < self.steps:
            raise IndexError(f"step {i} of {self.steps}")
        k = i + 1
        return k * self.first + self.growth * k * (k - 1) / 2


def decode_run_ends(
    model: CostModel, rows: int, padded_rows: int, history: int, steps: int
) -> Sequence[float]:
    """Cumulative end offsets of `steps` decode steps of an unchanged batch (each step's history
    grows by one token per row). Uses the model's own `decode_run_ends` when it has one."""
    fast = getattr(model, "decode_run_ends", None)
    if fast is not None:
        return fast(rows, padded_rows, history, steps)
    ends, total = [], 0.0
    for i in range(steps):
        total += model.decode_step_time(rows, padded_rows, history + i * rows)
        ends.append(total)
    return ends


def attention_pairs(spans: Sequence[tuple[int, int]]) -> float:
    """(query, key) pairs of causal attention over the spans: each new token sees all before it."""
    return sum((end - start) * (start + (end - start + 1) / 2.0) for start, end in spans)


def _is_real(value: object) -> bool:
    # A bool would pass as 0 or 1 (a 1 byte/s link, say); a string would fail the range test
    # with a TypeError that does not name the field.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    # A NaN or infinite cost would turn every time after it into NaN / inf, silently.
    if not _is_real(value) or not 0 <= value < math.inf:
        raise ValueError(f"{attribute.name} must be finite and >= 0, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    # A rate may be infinite (a free copy); NaN fails this test.
    if not _is_real(value) or not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen(kw_only=True)
class LinearCostModel:
    """Costs linear in the work: defaults sketch a K3-class model on one GB300-class GPU.

    They are assumptions for relative comparisons (routing, L2, admission), not measurements:
    prefill ~16k new tokens/s before attention, MLA prefill attention at 0.5 ns per
    (query, key) pair, a decode step of 10 ms plus 0.15 ms per row plus 3.5 ns per cached token
    read (a 576-wide bf16 row in 24 MLA layers is 27.6 KB per token at ~8 TB/s), 50 GB/s
    between prefill and decode ranks and 100 GB/s from host to device.
    """

    prefill_base_s: float = attrs.field(default=5e-3, validator=_non_negative)
    prefill_per_token_s: float = attrs.field(default=60e-6, validator=_non_negative)
    prefill_per_pair_s: float = attrs.field(default=0.5e-9, validator=_non_negative)
    decode_base_s: float = attrs.field(default=10e-3, validator=_non_negative)
    decode_per_row_s: float = attrs.field(default=0.15e-3, validator=_non_negative)
    decode_per_history_token_s: float = attrs.field(default=3.5e-9, validator=_non_negative)
    transfer_latency_s: float = attrs.field(default=1e-3, validator=_non_negative)
    transfer_bytes_per_s: float = attrs.field(default=50e9, validator=_positive)
    load_bytes_per_s: float = attrs.field(default=100e9, validator=_positive)

    def prefill_time(self, spans: Sequence[tuple[int, int]]) -> float:
        tokens = sum(end - start for start, end in spans)
        return (
            self.prefill_base_s
            + self.prefill_per_token_s * tokens
            + self.prefill_per_pair_s * attention_pairs(spans)
        )

    def decode_step_time(self, rows: int, padded_rows: int, history: int) -> float:
        # Padded rows cost compute like real ones; only real rows read a history.
        return (
            self.decode_base_s
            + self.decode_per_row_s * padded_rows
            + self.decode_per_history_token_s * history
        )

    def decode_run_ends(
        self, rows: int, padded_rows: int, history: int, steps: int
    ) -> ArithmeticEnds:
        # Step i costs first + growth * i: the ends are a closed-form arithmetic series.
        first = self.decode_step_time(rows, padded_rows, history)
        return ArithmeticEnds(first, self.decode_per_history_token_s * rows, steps)

    def transfer_time(self, nbytes: int) -> float:
        return self.transfer_latency_s + nbytes / self.transfer_bytes_per_s

    def load_time(self, nbytes: int) -> float:
        return nbytes / self.load_bytes_per_s


def _interp1(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through the points, extended linearly past both ends."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _list(value: object, name: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"cost table {name!r} must be a list, got {value!r}")
    return value


def _numbers(value: object, name: str) -> tuple[float, ...]:
    items = _list(value, name)
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in items):
        raise ValueError(f"cost table {name!r} must hold numbers, got {value!r}")
    return tuple(map(float, items))


@attrs.frozen
class Grid:
    """seconds[i][j] measured at (xs[i], ys[j]); bilinear inside, linear extension outside."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __attrs_post_init__(self) -> None:
        if not self.xs or not self.ys:
            raise ValueError("a cost table needs at least one point on each axis")
        for axis in (self.xs, self.ys):
            if not all(math.isfinite(v) for v in axis):
                raise ValueError(f"cost table axis must hold finite numbers, got {axis}")
            if any(b <= a for a, b in itertools.pairwise(axis)):
                raise ValueError(f"cost table axis must be strictly increasing, got {axis}")
        if len(self.seconds) != len(self.xs) or any(len(r) != len(self.ys) for r in self.seconds):
            raise ValueError(
                f"cost table has {len(self.seconds)} rows for {len(self.xs)} x values; each row "
                f"needs {len(self.ys)} entries"
            )
        for i, row in enumerate(self.seconds):
            for j, value in enumerate(row):
                if not 0 <= value < math.inf:
                    raise ValueError(
                        f"cost table seconds[{i}][{j}] must be finite and >= 0, got {value}"
                    )

    @classmethod
    def from_json(cls, obj: object, x: str, y: str) -> Grid:
        if not isinstance(obj, dict):
            raise ValueError(f"cost table section must be an object, got {type(obj).__name__}")
        try:
            return cls(
                _numbers(obj[x], x),
                _numbers(obj[y], y),
                tuple(_numbers(row, "seconds") for row in _list(obj["seconds"], "seconds")),
            )
        except KeyError as exc:
            raise ValueError(f"cost table section lacks {exc.args[0]!r}") from None

    def __call__(self, x: float, y: float) -> float:
        column = [_interp1(self.ys, row, y) for row in self.seconds]
        return max(_interp1(self.xs, column, x), 0.0)


@attrs.frozen(kw_only=True)
class TableCostModel:
    """Costs read from measurements (see docs/sim.md for the JSON layout):

    prefill[tokens][mean_context]: one forward of `tokens` new tokens whose average cached prefix
        is `mean_context`;
    decode[padded_rows][mean_history]: one decode step at a graph size with that mean history;
    transfer_bytes_per_s, load_bytes_per_s (+ transfer_latency_s).
    """

    prefill: Grid
    decode: Grid
    transfer_latency_s: float = attrs.field(default=1e-3, validator=_non_negative)
    transfer_bytes_per_s: float = attrs.field(default=50e9, validator=_positive)
    load_bytes_per_s: float = attrs.field(default=100e9, validator=_positive)

    @classmethod
    def from_file(cls, path: str | Path) -> TableCostModel:
        """Raises ValueError, naming the file, for a table that is not as docs/sim.md lays out."""
        try:
            return cls._from_json(json.loads(Path(path).read_text()))
        except (ValueError, OverflowError) as exc:  # JSONDecodeError; an integer past float
            raise ValueError(f"{path}: {exc}") from None
        except RecursionError:  # the JSON decoder recurses once per nesting level
            raise ValueError(f"{path}: not valid JSON (nested too deeply)") from None

    @classmethod
    def _from_json(cls, obj: object) -> TableCostModel:
        if not isinstance(obj, dict):
            raise ValueError(f"a cost table is a JSON object, got {type(obj).__name__}")
        extra = {}
        for name in ("transfer_latency_s", "transfer_bytes_per_s", "load_bytes_per_s"):
            value = obj.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"cost table {name!r} must be a number, got {value!r}")
            extra[name] = float(value)
        grids = {}
        for section, x, y in (
            ("prefill", "tokens", "mean_context"),
            ("decode", "padded_rows", "mean_history"),
        ):
            if section not in obj:
                raise ValueError(f"cost table lacks the {section!r} section")
            try:
                grids[section] = Grid.from_json(obj[section], x, y)
            except ValueError as exc:
                raise ValueError(f"{section}: {exc}") from None
        return cls(**grids, **extra)

    def prefill_time(self, spans: Sequence[tuple[int, int]]) -> float:
        tokens = sum(end - start for start, end in spans)
        if tokens == 0:
            return 0.0
        mean_context = sum((end - start) * start for start, end in spans) / tokens
        return self.prefill(tokens, mean_context)

    def decode_step_time(self, rows: int, padded_rows: int, history: int) -> float:
        return self.decode(padded_rows, history / rows if rows else 0.0)

    def transfer_time(self, nbytes: int) -> float:
        return self.transfer_latency_s + nbytes / self.transfer_bytes_per_s

    def load_time(self, nbytes: int) -> float:
        return nbytes / self.load_bytes_per_s


def verify_step_time(
    model: CostModel, rows: int, padded_rows: int, history: int, width: int
) -> float:
    """One speculative verify step: `rows` rows (graph size `padded_rows`) of `width` = k + 1
    positions each (the last token and k drafts), attending to `history` cached tokens in total.

    ASSUMPTION (not measured): it costs what the model's decode step of `rows * width` one-token
    rows costs, each position reading its request's history (history * width in total; a
    table's mean history per row is unchanged). That is an upper bound where the attention
    kernel reads a row's history once for all its positions; benchmarks/spec_verify.py measures
    the real ratio of a verify step to k + 1 decode steps (docs/perf/spec.md). width 1 is the
    decode step itself."""
    if width == 1:
        return model.decode_step_time(rows, padded_rows, history)
    return model.decode_step_time(rows * width, padded_rows * width, history * width)


class VerifyEnds(Sequence[float]):
    """Cumulative end offsets, per decode token, of a run of verify steps: token i (0-based) of
    every row is emitted by verify step floor(i / A), so it ends when that step ends (tokens of
    one step share its end). `verify_ends[v]`: the end of verify step v."""

    __slots__ = ("acceptance", "steps", "verify_ends")

    def __init__(self, verify_ends: Sequence[float], acceptance: float, steps: int) -> None:
        self.verify_ends, self.acceptance, self.steps = verify_ends, acceptance, steps

    def __len__(self) -> int:
        return self.steps

    def step_of(self, i: int) -> int:
        """The verify step that emits token i."""
        return int(i // self.acceptance)

    def __getitem__(self, i: int) -> float:  # type: ignore[override]
        if i < 0:
            i += self.steps
        if not 0 <= i < self.steps:
            raise IndexError(f"token {i} of {self.steps}")
        return self.verify_ends[self.step_of(i)]

    def last_of_step(self, i: int) -> int:
        """The last token emitted by the verify step that emits token i (a run cut while that
        step is in flight ends with it)."""
        return min(self.steps, math.ceil((self.step_of(i) + 1) * self.acceptance)) - 1

    def verify_steps(self, tokens: int) -> int:
        """Verify steps run to emit the first `tokens` tokens of every row."""
        return self.step_of(tokens - 1) + 1 if tokens > 0 else 0


def _acceptance(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not _is_real(value) or not 1 <= value <= 4:
        raise ValueError(f"acceptance_length must be in 1..4 tokens per step, got {value!r}")


@attrs.frozen(kw_only=True)
class SpeculativeCostModel:
    """`base` with speculative decoding: each decode step is a verify step of `num_steps` + 1
    positions per row (`verify_step_time`) that advances every decode row by
    `acceptance_length` tokens on average (tokens emitted per verify step: accepted drafts + 1;
    a fractional A is a mean rate, token i being emitted by verify step floor(i / A)). Prefill,
    transfers and loads cost what `base` says. A = 1 with num_steps 0 is plain decoding.

    The scheduler still advances a run of decode steps token by token (it reserves pages for
    them and checks each request's end); this model only decides when each token is out. A
    mixed prefill + decode forward of the aggregated mode decodes one token, as without it."""

    base: CostModel
    acceptance_length: float = attrs.field(default=1.0, validator=_acceptance)
    num_steps: int = attrs.field(default=0)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.num_steps, int) or not 0 <= self.num_steps <= 3:
            raise ValueError(f"num_steps must be an integer in 0..3, got {self.num_steps!r}")
        if self.acceptance_length > self.num_steps + 1:
            raise ValueError(
                f"acceptance_length {self.acceptance_length:g} exceeds num_steps + 1 "
                f"({self.num_steps + 1}): a verify step emits at most its drafts and one more"
            )

    @property
    def width(self) -> int:
        return self.num_steps + 1

    def prefill_time(self, spans: Sequence[tuple[int, int]]) -> float:
        return self.base.prefill_time(spans)

    def decode_step_time(self, rows: int, padded_rows: int, history: int) -> float:
        """One verify step."""
        return verify_step_time(self.base, rows, padded_rows, history, self.width)

    def decode_run_ends(self, rows: int, padded_rows: int, history: int, steps: int) -> VerifyEnds:
        a = self.acceptance_length
        ends, total = [], 0.0
        for v in range(int((steps - 1) // a) + 1 if steps else 0):
            # Before verify step v every row has emitted ceil(v * A) tokens of this run.
            total += self.decode_step_time(rows, padded_rows, history + rows * math.ceil(v * a))
            ends.append(total)
        return VerifyEnds(ends, a, steps)

    def transfer_time(self, nbytes: int) -> float:
        return self.base.transfer_time(nbytes)

    def load_time(self, nbytes: int) -> float:
        return self.base.load_time(nbytes)
