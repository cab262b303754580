"""What a P/D handoff tells each side: `Handoff` (prefill side), `Destination` (decode side).

Both go through whatever joins the two engines (a gateway; a test): `as_dict()` gives plain JSON
values and `from_dict` reads them back. Request ids that cross processes must be str or int.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

from tokenspeed.cache import CacheError
from tokenspeed.cache.handoff import ByteRange, CacheExtent, CacheLayout, transfer_ranges


class HandoffError(RuntimeError):
    """A handoff could not be done: the peer is gone or refused, a wait timed out, the
    destination expired, or the two sides disagree (layout, request). The message says which;
    nothing was freed on the side that raised."""


def wire_id(request_id: Hashable) -> str | int:
    """The request id as it crosses processes (JSON): a str or an int, else HandoffError."""
    if isinstance(request_id, bool) or not isinstance(request_id, str | int):
        raise HandoffError(
            f"request id {request_id!r}: a P/D request id must be a str or an int (it crosses "
            "processes as JSON)"
        )
    return request_id


def _top(value) -> tuple[tuple[int, float], ...] | None:
    return None if value is None else tuple((int(t), float(p)) for t, p in value)


@attrs.frozen(kw_only=True)
class FirstToken:
    """The token the prefill side sampled, with its log-probabilities when the request asked
    for them. It travels with the request: the decode side appends it and never samples it."""

    token: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = attrs.field(default=None, converter=_top)

    def as_dict(self) -> dict:
        top = None if self.top_logprobs is None else [list(p) for p in self.top_logprobs]
        return {"token": self.token, "logprob": self.logprob, "top_logprobs": top}

    @classmethod
    def from_dict(cls, data: dict) -> FirstToken:
        return cls(**data)


@attrs.frozen(kw_only=True)
class Handoff:
    """What the prefill side holds for a prefilled request (`PrefillEngine.export`): its first
    token, and where its cache is: the MLA rows of the prompt's `num_tokens` tokens in
    `extent.page_ids` and the live KDA state at `num_tokens` in `extent.live_slot`, laid out as
    `layout` says. `ranges(destination)` turns it into the byte ranges to move."""

    request_id: str | int
    num_tokens: int
    first: FirstToken
    layout: CacheLayout
    extent: CacheExtent

    def ranges(self, destination: Destination) -> list[ByteRange]:
        if destination.request_id != self.request_id:
            raise HandoffError(
                f"destination is for request {destination.request_id!r}, not {self.request_id!r}"
            )
        try:
            return transfer_ranges(self.layout, self.extent, destination.layout, destination.extent)
        except CacheError as exc:  # different models or page sizes; a foreign destination
            raise HandoffError(f"request {self.request_id!r}: {exc}") from exc

    @property
    def nbytes(self) -> int:
        """Bytes a transfer of the whole request moves (pages from 0)."""
        lay, n = self.layout, self.num_tokens
        pages = -(-n // lay.page_size)
        rows = sum(lay.rows_of_page(j, n) for j in range(pages)) * lay.mla_row_bytes
        return lay.num_mla_layers * rows + lay.num_kda_layers * (
            lay.conv_bytes + lay.recurrent_bytes
        )

    def as_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "num_tokens": self.num_tokens,
            "first": self.first.as_dict(),
            "layout": self.layout.as_dict(),
            "extent": self.extent.as_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> Handoff:
        return cls(
            request_id=data["request_id"],
            num_tokens=data["num_tokens"],
            first=FirstToken.from_dict(data["first"]),
            layout=CacheLayout.from_dict(data["layout"]),
            extent=CacheExtent.from_dict(data["extent"]),
        )


@attrs.frozen(kw_only=True)
class Destination:
    """Where the decode side wants a request's cache (`DecodeEngine.admit`): the pages and live
    slot it allocated (`extent`; pages before `extent.first_page` are its own prefix hit and
    are not written), its layout, and how to reach it (`endpoint`: the transport's kind, its
    notification address, and for a one-sided transport its session and registered regions).

    deadline: Unix time after which the prefill side must not start writing; the decode side
    keeps the destination until it is told the transfer ended, or until the deadline plus its
    grace period (longer than any write may run) has passed."""

    request_id: str | int
    num_tokens: int
    layout: CacheLayout
    extent: CacheExtent
    endpoint: dict
    deadline: float

    def as_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "num_tokens": self.num_tokens,
            "layout": self.layout.as_dict(),
            "extent": self.extent.as_dict(),
            "endpoint": self.endpoint,
            "deadline": self.deadline,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Destination:
        return cls(
            request_id=data["request_id"],
            num_tokens=data["num_tokens"],
            layout=CacheLayout.from_dict(data["layout"]),
            extent=CacheExtent.from_dict(data["extent"]),
            endpoint=data["endpoint"],
            deadline=data["deadline"],
        )
