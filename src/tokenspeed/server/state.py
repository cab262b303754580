"""`ServerState`: what every handler of one app shares."""

from __future__ import annotations

import time

import attrs
from aiohttp import web

from .admission import Admission
from .config import ServerConfig
from .metrics import ServerMetrics
from .role import Role
from .served_model import ServedModel

STATE = web.AppKey("tokenspeed_state", object)


class DecodeRate:
    """Generated tokens per second over the last `window_s` or more (what GET /v1/loads
    reports as `gen_throughput`): the engine's decode-token counter sampled at each read, the
    rate taken between the last sample at least `window_s` old and now."""

    def __init__(self, window_s: float = 1.0, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._since: tuple[float, int] | None = None  # (time, tokens) the rate is taken from
        self._rate = 0.0

    def read(self, tokens: int) -> float:
        now = self._clock()
        if self._since is None or tokens < self._since[1]:  # first read, or counters reset
            self._since = (now, tokens)
            return self._rate
        then, before = self._since
        if now - then >= self.window_s:
            self._rate = (tokens - before) / (now - then)
            self._since = (now, tokens)
        return self._rate


@attrs.define
class ServerState:
    role: Role
    model: ServedModel
    config: ServerConfig
    admission: Admission
    metrics: ServerMetrics = attrs.Factory(ServerMetrics)
    decode_rate: DecodeRate = attrs.Factory(DecodeRate)
    started: float = attrs.Factory(time.time)  # unix time (GET /server_info's uptime)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]
