"""What the ops' frozen attrs tuning classes share: validator factories for their knobs, and the
entry points' check of a `tuning` argument.

Every validator raises ValueError naming the field, "{field} must be {what}, got {value!r}" (for
`one_of`: "{field} is {alternatives}, not {value!r}"); None passes wherever the knob is optional
(None: "by shape"), the default of most factories.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar

T = TypeVar("T")
# An attrs validator: (instance, attribute, value) -> None, raising on a bad value.
Validator = Callable[[Any, Any, Any], None]


def is_pow2(n: int) -> bool:
    """Whether n is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


def check(ok: Callable[[Any], bool], what: str, *, optional: bool = True) -> Validator:
    """A validator refusing a value for which `ok` is false (None passes when optional)."""

    def validate(instance, attribute, value) -> None:
        if not (optional and value is None) and not ok(value):
            raise ValueError(f"{attribute.name} must be {what}, got {value!r}")

    return validate


def integer(
    *, low: int = 1, high: int | None = None, pow2: bool = False, optional: bool = True
) -> Validator:
    """An int in low..high (high None: no bound), with pow2 a power of two (or 0 when low is 0):
    "a power of two in 1..32", "a power of two >= 16", "0 or a power of two", "an int >= 1"."""

    def ok(v) -> bool:
        if not isinstance(v, int) or v < low or (high is not None and v > high):
            return False
        return not pow2 or is_pow2(v) or v == 0

    bound = f" in {low}..{high}" if high is not None else f" >= {low}"
    if not pow2:
        what = "an int" + bound
    elif low == 0:
        what = "0 or a power of two"
    else:
        what = "a power of two" + ("" if bound == " >= 1" else bound)
    return check(ok, what, optional=optional)


def warp_count(*, optional: bool = True) -> Validator:
    """A kernel's num_warps: a power of two in 1..32."""
    return integer(low=1, high=32, pow2=True, optional=optional)


def boolean(*, optional: bool = True) -> Validator:
    """True or False (or None when optional); not 0 / 1."""
    what = "True, False or None" if optional else "True or False"
    return check(lambda v: isinstance(v, bool), what, optional=optional)


def one_of(values: Collection, *, optional: bool = False) -> Validator:
    """One of `values` (e.g. Triton's eviction policies, a kernel's name); its ValueError reads
    "kernel is 'gluon', 'triton' or None, not 'cuda'"."""
    names = [repr(v) for v in values] + (["None"] if optional else [])
    what = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"

    def validate(instance, attribute, value) -> None:
        if not (optional and value is None) and value not in values:
            raise ValueError(f"{attribute.name} is {what}, not {value!r}")

    return validate


def pair_of(values: Collection) -> Validator:
    """A 2-tuple of members of `values` (e.g. a (load, store) pair of eviction policies)."""
    return check(
        lambda v: isinstance(v, tuple) and len(v) == 2 and set(v) <= set(values),
        f"a pair of {tuple(values)!r}",
        optional=False,
    )


def instance_of(cls: type, *, optional: bool = True) -> Validator:
    """An instance of cls (a nested tuning object)."""
    return check(lambda v: isinstance(v, cls), f"a {cls.__name__}", optional=optional)


def tuning_or_default(value: T | None, cls: type[T], name: str = "tuning") -> T:
    """An op entry point's tuning argument: `value`, or cls() (the defaults) when None; anything
    but a cls is a TypeError ("tuning must be a KdaDecodeTuning or None, got dict")."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__} or None, got {type(value).__name__}")
    return value
