"""A page-counting `CachePort` for scheduler unit tests only (the simulator uses the real cache).

It keeps just enough state to check the schedulers' side of the contract: pages per request,
a global free count, published prefixes with their checkpoints, and a log of calls.
"""

from __future__ import annotations

from collections.abc import Hashable

from tokenspeed.sched.cache_port import AdmissionError
from tokenspeed.sched.request import Request


class FakeCache:
    def __init__(self, *, page_size: int = 16, num_pages: int = 1000, live_slots: int = 100):
        self.page_size = page_size
        self.num_pages = num_pages
        self.live_slots = live_slots
        self.pages: dict[Hashable, int] = {}  # rid -> pages held
        self.published: set[Hashable] = set()  # page keys that are matchable
        self.checkpointed: set[Hashable] = set()  # key of the page ending at a checkpoint
        self.log: list[tuple] = []
        self.kinds: list[tuple] = []  # (rid, length, turn_end, from_live) per checkpoint
        self.failing: set[Hashable] = set()  # requests whose acquire fails (a device error)

    # -- helpers for tests
    @property
    def used_pages(self) -> int:
        return sum(self.pages.values())

    def holds(self, rid: Hashable) -> bool:
        return rid in self.pages

    # -- CachePort
    def lookup(self, req: Request, limit: int) -> int:
        best = 0
        for i, key in enumerate(req.keys):
            length = (i + 1) * self.page_size
            if length > limit or key not in self.published:
                break
            if key in self.checkpointed:
                best = length
        return best

    def acquire(self, req: Request, limit: int) -> int | None:
        if req.rid in self.pages:
            raise AssertionError(f"{req.rid} acquired twice")
        if req.rid in self.failing:
            raise AdmissionError("could not set up its cache: RuntimeError('device fault')")
        if len(self.pages) >= self.live_slots:
            return None
        hit = self.lookup(req, limit)
        need = hit // self.page_size
        if need > self.free_pages():
            return None
        self.pages[req.rid] = need
        self.log.append(("acquire", req.rid, hit))
        return hit

    def reserve(self, req: Request, length: int) -> bool:
        have = self.pages[req.rid]
        need = -(-length // self.page_size)
        if need <= have:
            return True
        if need - have > self.free_pages():
            return False
        self.pages[req.rid] = need
        self.log.append(("reserve", req.rid, length))
        return True

    def covered(self, req: Request) -> int:
        return self.pages[req.rid] * self.page_size

    def checkpoint(
        self, req: Request, length: int, *, turn_end: bool, from_live: bool
    ) -> int | None:
        assert length % self.page_size == 0, length
        assert length <= self.covered(req), (length, self.covered(req))
        key = req.keys[length // self.page_size - 1]
        self.log.append(("checkpoint", req.rid, length))
        self.kinds.append((req.rid, length, turn_end, from_live))
        if key in self.checkpointed:
            return None
        self.checkpointed.add(key)
        return len(self.checkpointed)  # a fake slot id

    def publish(self, req: Request, length: int) -> None:
        assert length % self.page_size == 0, length
        assert req.keys[length // self.page_size - 1] in self.checkpointed
        self.published.update(req.keys[: length // self.page_size])
        self.log.append(("publish", req.rid, length))

    def release(self, req: Request) -> None:
        del self.pages[req.rid]
        self.log.append(("release", req.rid))

    def free_pages(self) -> int:
        return self.num_pages - self.used_pages

    def calls(self, name: str, rid: Hashable | None = None) -> list[tuple]:
        return [c for c in self.log if c[0] == name and (rid is None or c[1] == rid)]


def make_request(
    rid: Hashable,
    prompt_len: int,
    max_new_tokens: int = 4,
    *,
    page_size: int = 16,
    content: Hashable = None,
    session: Hashable = None,
) -> Request:
    """A request whose page keys describe `content` (requests with equal content share keys)."""
    content = rid if content is None else content
    num_pages = (prompt_len + max_new_tokens) // page_size
    keys = [(content, i) for i in range(num_pages)]
    return Request(rid, prompt_len, max_new_tokens, keys=keys, session=session)
