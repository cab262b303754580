"""`HandoffSide`: what the prefill and the decode engine of a P/D pair share: the transport
that moves a request's cache between them (given, or one of the engine's own, closed with it),
this engine's device regions registered on it, and the cache's handoff layout."""

from __future__ import annotations

from tokenspeed.cache import HostCache
from tokenspeed.cache.handoff import device_regions
from tokenspeed.model import KimiForCausalLM

from ..config import EngineConfig
from ..engine import Engine
from ..tokenizer import Tokenizer
from .transport import Transport, make_transport


class HandoffSide(Engine):
    """An engine with a P/D transport. transport: None builds one (`make_transport()` on
    `transport_host`), owned and closed by the engine; a given one is the caller's to close."""

    def __init__(
        self,
        model: KimiForCausalLM,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        l2: HostCache | None = None,
        *,
        transport: Transport | None = None,
        transport_host: str = "127.0.0.1",
    ) -> None:
        super().__init__(model, tokenizer, config, l2)
        self._owns_transport = transport is None
        if transport is None:
            transport = make_transport(host=transport_host, device=self.device)
        self.transport = transport
        self.transport.register(device_regions(self.cache.storage))
        self.layout = self.cache.handoff_layout()

    def close(self) -> None:
        if self._owns_transport:
            self.transport.close()
        super().close()
