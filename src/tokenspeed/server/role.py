"""What this worker does with a request: the seam between the HTTP layer and the engine.

The app (`tokenspeed.server.app`) never touches an engine. It calls its role:

- `generate(request_id, prompt_token_ids, params, prompt)`: the request's cumulative outputs
  (an async iterator; closing it early aborts the request);
- `load()`: the `LoadSnapshot` GET /v1/loads answers (fast, never waits for a step);
- `metrics` (the engine's `EngineMetrics`), `cache_stats()` and `check_integrity()` for
  GET /metrics and GET /health?integrity=1;
- `close()` at shutdown: abort what runs, deliver the last outputs.

`AggregatedRole`, the only role today, runs prefill and decode on one `AsyncEngine`. A P/D
split adds roles with the same methods, chosen by `--role` in `make_role`: a prefill role would
compute the prompt and hand the request (its pages and KDA state) to a decode worker through the
P/D transfer package, then relay that worker's outputs (or answer with a handle the gateway
follows); a decode role would take in transferred requests and continue them. The HTTP layer,
its validation, streaming and errors stay as they are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Protocol

from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.load import LoadSnapshot
from tokenspeed.runtime.metrics import EngineMetrics
from tokenspeed.runtime.outputs import RequestOutput
from tokenspeed.runtime.sampling_params import SamplingParams

from .config import ROLES, ServerConfigError


class Role(Protocol):
    name: str

    def generate(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    def load(self) -> LoadSnapshot: ...

    @property
    def metrics(self) -> EngineMetrics: ...

    async def cache_stats(self):  # the cache's `CacheStats`
        ...

    async def check_integrity(self) -> None: ...

    async def close(self) -> None: ...


class AggregatedRole:
    """Prefill and decode of every request on one `AsyncEngine`."""

    name = "aggregated"

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def generate(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request_id, prompt_token_ids, params, prompt=prompt)

    def load(self) -> LoadSnapshot:
        return self.engine.load()

    @property
    def metrics(self) -> EngineMetrics:
        return self.engine.engine.metrics

    async def cache_stats(self):
        """The cache's `CacheStats` (occupancy, hit and L2 counters), read between two steps."""
        return await self.engine.run_exclusive(lambda engine: engine.cache.stats())

    async def check_integrity(self) -> None:
        """Raises the cache's IntegrityError unless every pool adds up (between two steps)."""
        await self.engine.run_exclusive(lambda engine: engine.check_integrity())

    async def close(self) -> None:
        await self.engine.close()


def make_role(name: str, engine: AsyncEngine) -> Role:
    if name == "aggregated":
        return AggregatedRole(engine)
    raise ServerConfigError(f"role must be one of {list(ROLES)}, got {name!r}")
