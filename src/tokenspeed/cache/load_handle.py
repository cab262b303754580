"""The handle of one request's prefix being copied into the device tier, layer by layer."""

from __future__ import annotations

from collections.abc import Sequence

from .events import CompletionEvent


class LoadHandle:
    """Per-layer completion of the copies a request's prefix hit needs before the forward reads it.

    `wait_mla(l)` / `wait_kda(l)` make the consumer wait until layer l's pages / state are in
    place (on CUDA the current stream waits and the host does not block; on CPU the calling thread
    blocks). A layer may also wait on copies started for another request that share pages with
    this one. `synchronize()` blocks the host until everything has arrived and raises
    `TransferError` if a copy failed. A request with nothing to load gets a handle whose events
    are all complete.

    l2_pages / l2_checkpoint: what this request itself fetched from the host tier.
    """

    def __init__(
        self,
        mla: Sequence[Sequence[CompletionEvent]],
        kda: Sequence[Sequence[CompletionEvent]],
        *,
        l2_pages: int = 0,
        l2_checkpoint: bool = False,
        keepalive: Sequence[object] = (),
    ) -> None:
        # Per layer, the events to wait for (owned by the handle; never mutated afterwards).
        self._mla = mla
        self._kda = kda
        self.l2_pages = l2_pages
        self.l2_checkpoint = l2_checkpoint
        # Host staging buffers the copies read from; dropped once everything has completed.
        self._keepalive = list(keepalive)
        # Most handles wait for nothing (a hit in L1, a miss, a metadata-only cache).
        self._nothing = not any(mla) and not any(kda)

    @property
    def num_mla_layers(self) -> int:
        return len(self._mla)

    @property
    def num_kda_layers(self) -> int:
        return len(self._kda)

    def mla_events(self, layer: int) -> Sequence[CompletionEvent]:
        return self._mla[layer]

    def kda_events(self, layer: int) -> Sequence[CompletionEvent]:
        return self._kda[layer]

    def wait_mla(self, layer: int) -> None:
        for event in self._mla[layer]:
            event.wait()

    def wait_kda(self, layer: int) -> None:
        for event in self._kda[layer]:
            event.wait()

    def wait_all_kda(self) -> None:
        """`wait_kda` for every layer (before the live state is read as a whole)."""
        if not self._nothing:
            for layer in self._kda:
                for event in layer:
                    event.wait()

    def done(self) -> bool:
        """True once every copy has finished (never blocks)."""
        return all(e.query() for layer in (*self._mla, *self._kda) for e in layer)

    def synchronize(self) -> None:
        if not self._nothing:
            for layer in (*self._mla, *self._kda):
                for event in layer:
                    event.synchronize()
        self._keepalive.clear()
