"""LiveSlotManager: one owner per slot, the sink never handed out."""

from __future__ import annotations

import pytest

from tokenspeed.cache import CacheFullError, IntegrityError
from tokenspeed.cache.kda_slots import SINK_SLOT, LiveSlotManager


def test_slots_have_one_owner_and_the_sink_is_reserved():
    slots = LiveSlotManager(3)
    a, b = slots.acquire("a"), slots.acquire("b")
    assert SINK_SLOT not in (a, b) and a != b
    with pytest.raises(CacheFullError):
        slots.acquire("c")
    slots.check_integrity({a: "a", b: "b"})
    with pytest.raises(IntegrityError):
        slots.check_integrity({a: "a"})
    slots.release(a)
    with pytest.raises(IntegrityError):
        slots.release(a)
    slots.check_integrity({b: "b"})
