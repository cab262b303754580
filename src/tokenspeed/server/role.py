"""What this worker does with a request: the seam between the HTTP layer and the engine.

The app (`tokenspeed.server.app`) never touches an engine. It calls its role:

- `generate(request_id, prompt_token_ids, params, prompt)`: the request's cumulative outputs
  (an async iterator; closing it early aborts the request);
- `load()`: the `LoadSnapshot` GET /v1/loads answers (fast, never waits for a step);
- `metrics` (the engine's `EngineMetrics`), `cache_stats()` and `check_integrity()` for
  GET /metrics and GET /health?integrity=1;
- `close()` at shutdown: abort what runs, deliver the last outputs.

A role may also have `install(app)`, called by `build_app`: what it adds to the app (a
middleware, startup and cleanup hooks).

`AggregatedRole` runs prefill and decode on one `AsyncEngine`. A prefill/decode split behind
smg's P/D mode uses the two roles of pd_roles.py, chosen by `--role` (`make_engine` builds their
engines, `make_role` the role): `PrefillRole` prefills on a `PrefillEngine` and hands each request
to the decode worker that registered its room with its bootstrap server; `DecodeRole` admits
each request on a `DecodeEngine`, registers its destination there, and streams it from the first
token on. The HTTP layer, its validation, streaming and errors stay as they are.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Protocol

from tokenspeed.runtime.async_engine import AsyncEngine
from tokenspeed.runtime.config import EngineConfig
from tokenspeed.runtime.engine import Engine
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


class EngineRole:
    """What every role does with its `AsyncEngine` alone: load, metrics, cache stats, the
    integrity check and closing it. A role adds `generate` (and whatever else it needs)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

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


class AggregatedRole(EngineRole):
    """Prefill and decode of every request on one `AsyncEngine`."""

    name = "aggregated"

    def generate(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(request_id, prompt_token_ids, params, prompt=prompt)


def make_engine(
    name: str,
    model,
    tokenizer=None,
    config: EngineConfig | None = None,
    l2=None,
    *,
    host: str = "127.0.0.1",
    timeout_s: float | None = None,
) -> Engine:
    """The engine role `name` runs on: an `Engine`, or for a P/D role a `PrefillEngine` /
    `DecodeEngine` whose transfers listen on `host` (loopback for a wildcard address: give the
    worker's own address to split across machines). timeout_s: the decode side's destination
    deadline (default `DEFAULT_PD_TIMEOUT_S`)."""
    if name == "aggregated":
        return Engine(model, tokenizer, config, l2)
    from tokenspeed.runtime.pd import DecodeEngine, PrefillEngine

    from .pd_roles import DEFAULT_PD_TIMEOUT_S

    where = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    if name == "prefill":
        return PrefillEngine(model, tokenizer, config, l2, transport_host=where)
    if name == "decode":
        deadline = DEFAULT_PD_TIMEOUT_S if timeout_s is None else timeout_s
        return DecodeEngine(model, tokenizer, config, l2, transport_host=where, deadline_s=deadline)
    raise ServerConfigError(f"role must be one of {list(ROLES)}, got {name!r}")


def make_role(
    name: str,
    engine: AsyncEngine,
    *,
    host: str = "127.0.0.1",
    bootstrap_port: int | None = None,
    timeout_s: float | None = None,
) -> Role:
    """The role `name` over `engine` (built by `make_engine`). A prefill role listens for the
    decode workers' registrations on host:bootstrap_port (default 8998; 0: a free port, logged);
    timeout_s bounds every wait for the other half of a request (default 60 s)."""
    if name == "aggregated":
        return AggregatedRole(engine)
    from .pd_roles import DEFAULT_BOOTSTRAP_PORT, DEFAULT_PD_TIMEOUT_S, DecodeRole, PrefillRole

    timeout_s = DEFAULT_PD_TIMEOUT_S if timeout_s is None else timeout_s
    if name == "prefill":
        port = DEFAULT_BOOTSTRAP_PORT if bootstrap_port is None else bootstrap_port
        return PrefillRole(engine, host=host, bootstrap_port=port, timeout_s=timeout_s)
    if name == "decode":
        return DecodeRole(engine, timeout_s=timeout_s)
    raise ServerConfigError(f"role must be one of {list(ROLES)}, got {name!r}")
