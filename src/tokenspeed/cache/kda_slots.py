"""Live KDA state slots: one per running request, holding its conv window and recurrent state as
the forward advances them. Slot 0 is the sink that padded rows of a captured graph write to."""

from __future__ import annotations

from ..types import RequestId, SlotId
from .errors import CacheFullError, IntegrityError
from .pool import SlotPool

SINK_SLOT: SlotId = 0


class LiveSlotManager:
    """Slots [0, num_slots), slot 0 reserved; each other slot owned by at most one request."""

    def __init__(self, num_slots: int) -> None:
        self.pool = SlotPool(num_slots, reserved=(SINK_SLOT,))
        self.owner: dict[SlotId, RequestId] = {}

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def acquire(self, request_id: RequestId) -> SlotId:
        if self.pool.num_free == 0:
            raise CacheFullError(
                f"all {self.pool.capacity} live KDA slots are taken (max_live_requests)"
            )
        slot = self.pool.allocate_one()
        self.owner[slot] = request_id
        return slot

    def release(self, slot: SlotId) -> None:
        if slot not in self.owner:
            raise IntegrityError(f"release of unowned live slot {slot}")
        del self.owner[slot]
        self.pool.free_one(slot)

    def check_integrity(self, expected_owner: dict[SlotId, RequestId]) -> None:
        """`expected_owner`: slot -> request, from the live requests."""
        self.pool.check_integrity()
        if SINK_SLOT in self.owner or self.pool.is_free(SINK_SLOT):
            raise IntegrityError("the sink slot is owned or on the free list")
        if self.owner != expected_owner:
            raise IntegrityError("live slot owners disagree with the live requests")
        if any(self.pool.is_free(s) for s in self.owner):
            raise IntegrityError("an owned live slot is on the free list")
        if len(self.owner) + self.pool.num_free != self.pool.capacity:
            raise IntegrityError("owned + free live slots != capacity")
