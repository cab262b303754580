"""Joining the two halves of a P/D request: its prefill and its decode admission.

Independent admission (the default): a routed request enters the prefill queue at once and, in
parallel, the decode admission queue of its decode rank. The KV/state transfer starts only when
both are done; a prefill that finishes first stays pinned on its prefill rank (backpressure).
Coupled admission (the baseline): the request enters the prefill queue only after its decode rank
has admitted it, so no prefill result ever waits, but prefill sits idle behind decode.

The gate is bookkeeping only: the caller enqueues, runs transfers and reports events back.
"""

from __future__ import annotations

from collections.abc import Hashable

from tokenspeed.sched.config import AdmissionPolicy


class TransferGate:
    def __init__(self, policy: AdmissionPolicy = AdmissionPolicy.INDEPENDENT) -> None:
        self.policy = AdmissionPolicy(policy)
        self._prefilled: set[Hashable] = set()
        self._admitted: set[Hashable] = set()

    def on_route(self, rid: Hashable) -> bool:
        """A request was routed; True when its prefill may be queued now."""
        return self.policy is AdmissionPolicy.INDEPENDENT

    def on_decode_admitted(self, rid: Hashable) -> tuple[bool, bool]:
        """Decode reserved the destination. Returns (queue prefill now, start transfer now)."""
        self._admitted.add(rid)
        if rid in self._prefilled:
            self._clear(rid)
            return False, True
        return self.policy is AdmissionPolicy.COUPLED, False

    def on_prefill_done(self, rid: Hashable) -> bool:
        """Prefill finished (result pinned). True when the transfer may start now."""
        if rid in self._admitted:
            self._clear(rid)
            return True
        self._prefilled.add(rid)
        return False

    def forget(self, rid: Hashable) -> None:
        """The request ended early (aborted, or finished in prefill with a one-token answer)."""
        self._clear(rid)

    def waiting_for_decode(self) -> int:
        """Prefilled requests held back by decode admission (pinned results)."""
        return len(self._prefilled)

    def _clear(self, rid: Hashable) -> None:
        self._prefilled.discard(rid)
        self._admitted.discard(rid)
