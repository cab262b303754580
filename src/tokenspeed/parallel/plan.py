"""`parallelize`: apply a plan of strategies to a built model, in a defined order.

A strategy is a transform (`apply_x(model, groups, *, log=None) -> TransformReport`) with the
facts `parallelize` needs to compose it: where it goes in the order, which `ParallelDims` degree
sizes it, and which strategies it cannot be combined with. Strategies live in a `Registry`, an
ordinary object: start from `default_registry()` and add your own with `with_strategy` (no
process-wide table; two registries in one process do not see each other).

The order of the built-in strategies: attention first (`tp_subgroup` / `tep` shard projections
and heads, `dcp` splits the MLA cache), then the experts (`dep` or `dwdp`). Each later transform
sees the modules the earlier ones left, which is what their docstrings' preconditions describe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
from torch import nn

from .comm import CommLog
from .dims import ParallelError
from .groups import ParallelGroups
from .report import TransformReport

Transform = Callable[..., TransformReport]
Check = Callable[[nn.Module, ParallelGroups], None]


@attrs.frozen(kw_only=True)
class Strategy:
    """name: how plans name it. apply: the transform. order: strategies run by increasing
    order (ties keep the plan's order). degree: the `ParallelDims` field that sizes it (a plan
    may name it only when that degree is > 1), or None when it needs no group of its own.
    conflicts: strategies it cannot be combined with in one plan. check: `check(model, groups)`
    raises (`ParallelError`) when the transform would refuse the model, changing nothing;
    `parallelize` runs the checks of every strategy of a plan before applying any (so a plan
    is refused before anything changes). It sees the model as given to `parallelize`: what it
    checks is what the earlier strategies of a plan leave alone (conflicts cover the rest)."""

    name: str
    apply: Transform
    order: int
    degree: str | None = None
    conflicts: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    check: Check | None = None


@attrs.frozen
class Registry:
    """The strategies a plan may name, by name."""

    strategies: tuple[Strategy, ...] = ()

    def __attrs_post_init__(self) -> None:
        names = [s.name for s in self.strategies]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ParallelError(f"strategies registered twice: {twice}")

    def with_strategy(self, strategy: Strategy) -> Registry:
        """A registry with `strategy` added (this one is left as it is)."""
        return Registry((*self.strategies, strategy))

    def __getitem__(self, name: str) -> Strategy:
        for strategy in self.strategies:
            if strategy.name == name:
                return strategy
        raise ParallelError(
            f"no strategy named {name!r}; registered: {sorted(s.name for s in self.strategies)}"
        )

    def names(self) -> list[str]:
        return [s.name for s in self.strategies]


def default_registry() -> Registry:
    """The built-in strategies."""
    from .dcp import apply_dcp, check_dcp
    from .dep import apply_dep, check_dep
    from .dwdp import apply_dwdp, check_dwdp
    from .tp import apply_tp, check_tp
    from .tp_subgroup import apply_tp_subgroup, check_tp_subgroup

    return Registry(
        (
            Strategy(
                name="tp_subgroup",
                apply=apply_tp_subgroup,
                order=10,
                degree="tp",
                check=check_tp_subgroup,
            ),
            Strategy(
                name="tep",
                apply=apply_tp,
                order=10,
                degree="tep",
                conflicts={"tp_subgroup", "dwdp"},
                check=check_tp,
            ),
            Strategy(
                name="dcp",
                apply=apply_dcp,
                order=20,
                degree="dcp",
                conflicts={"tep"},
                check=check_dcp,
            ),
            Strategy(
                name="dep",
                apply=apply_dep,
                order=30,
                degree="ep",
                conflicts={"tep"},
                check=check_dep,
            ),
            Strategy(
                name="dwdp",
                apply=apply_dwdp,
                order=30,
                degree="dwdp",
                conflicts={"dep", "tep"},
                check=check_dwdp,
            ),
        )
    )


def default_plan(groups: ParallelGroups, registry: Registry) -> list[str]:
    """Every registered strategy whose degree is above 1 in the layout."""
    dims = groups.dims
    return [s.name for s in registry.strategies if s.degree and getattr(dims, s.degree) > 1]


def parallelize(
    model: nn.Module,
    groups: ParallelGroups,
    plan: Sequence[str] | None = None,
    *,
    registry: Registry | None = None,
    log: CommLog | None = None,
) -> list[TransformReport]:
    """Apply `plan` (strategy names; default: every strategy the layout sizes) to `model` in
    place for this rank, in the registry's order; returns each transform's report.

    Refused before anything changes: a plan given as one string (give a list of names), an
    unknown name, a name twice, a strategy whose degree is 1 in the layout, two strategies that
    conflict, degrees the model cannot be split by, and a model a strategy's `check` refuses."""
    if isinstance(plan, str):
        raise ParallelError(
            f"parallelize: the plan is a list of strategy names, got the string {plan!r} "
            f"(write [{plan!r}])"
        )
    registry = registry or default_registry()
    names = list(default_plan(groups, registry) if plan is None else plan)
    strategies = [registry[name] for name in names]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ParallelError(f"the plan names {twice} more than once")
    dims = groups.dims
    for s in strategies:
        if s.degree is not None and getattr(dims, s.degree) == 1:
            raise ParallelError(
                f"the plan names {s.name!r}, but ParallelDims.{s.degree} is 1: nothing to split"
            )
        clash = sorted(s.conflicts & set(names))
        if clash:
            raise ParallelError(f"{s.name!r} cannot be combined with {clash} in one plan")
    config = getattr(model, "config", None)
    if config is not None:
        dims.check_model(config)
    ordered = sorted(strategies, key=lambda s: s.order)  # stable: ties keep the plan's order
    for s in ordered:
        if s.check is not None:
            s.check(model, groups)
    return [s.apply(model, groups, log=log) for s in ordered]
