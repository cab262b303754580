"""`Admission`: the cap on engine requests waiting or running at once (`max_pending`), past
which the server answers 503 instead of queueing without bound, and the shutdown gate."""

from __future__ import annotations

from .errors import ApiError, bad_request

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.pending = 0  # engine requests admitted and not yet ended
        self.closed = False  # shutting down: nothing new is admitted

    def enter(self, count: int) -> None:
        """Admit `count` engine requests (one call's prompts x n) or raise the ApiError."""
        if self.closed:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if count > self.max_pending:
            raise bad_request(
                f"this call asks for {count} generations (prompts x n), more than the server "
                f"ever runs at once ({self.max_pending})",
                "n",
            )
        if self.pending + count > self.max_pending:
            raise ApiError(
                503,
                f"the server is overloaded: {self.pending} requests waiting or running (at most "
                f"{self.max_pending}); retry later",
                code="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.pending += count

    def leave(self, count: int) -> None:
        self.pending -= count
