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
