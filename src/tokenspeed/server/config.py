"""`ServerConfig`: how the HTTP worker listens and what it admits (the engine's own settings are
an `EngineConfig`)."""

from __future__ import annotations

from attrs import field, frozen

DEFAULT_HOST = "127.0.0.1"  # loopback: exposing the worker is an explicit --host 0.0.0.0
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 200k-token prompt as token ids is ~1.4 MB of JSON
DEFAULT_MAX_PENDING = 256
ROLES = ("aggregated", "prefill", "decode")  # P/D roles: server/pd_roles.py


class ServerConfigError(ValueError):
    """A server setting that cannot work; the message names it."""


def _non_negative(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ServerConfigError(f"{attribute.name} must be an integer >= 0, got {value!r}")


def _positive(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ServerConfigError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _role(instance, attribute, value) -> None:
    if value not in ROLES:
        raise ServerConfigError(f"role must be one of {list(ROLES)}, got {value!r}")


def _api_key(instance, attribute, value) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ServerConfigError("api_key must be a non-empty string or None")


@frozen(kw_only=True)
class ServerConfig:
    """model_name: the id clients pass as `model` (and GET /v1/models lists). port 0: a free
    port, chosen when the server binds. api_key: when set, /v1/* needs `Authorization: Bearer
    KEY` (401 otherwise); /health and /metrics stay open, as probes and scrapers expect.
    max_body_bytes: larger request bodies get 413. max_pending: engine requests (each
    completion of each prompt) waiting or running at once; past it, 503. role: what this
    worker does with a request (`tokenspeed.server.role`): "aggregated", or one half of a P/D
    split, "prefill" / "decode" (`pd_roles.py`). (The chat template belongs to the model:
    `ServedModel`.)"""

    model_name: str
    host: str = DEFAULT_HOST
    port: int = field(default=DEFAULT_PORT, validator=_non_negative)
    api_key: str | None = field(default=None, validator=_api_key)
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, validator=_positive)
    max_pending: int = field(default=DEFAULT_MAX_PENDING, validator=_positive)
    role: str = field(default="aggregated", validator=_role)
