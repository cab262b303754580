"""`ServerState`: what every handler of one app shares."""

from __future__ import annotations

import attrs
from aiohttp import web

from .admission import Admission
from .config import ServerConfig
from .metrics import ServerMetrics
from .role import Role
from .served_model import ServedModel

STATE = web.AppKey("tokenspeed_state", object)


@attrs.define
class ServerState:
    role: Role
    model: ServedModel
    config: ServerConfig
    admission: Admission
    metrics: ServerMetrics = attrs.Factory(ServerMetrics)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE]
