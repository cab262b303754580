"""Host tier (L2) backends behind one interface (`HostCache`): `LocalHostCache` (in-process,
the embedded default) and `MooncakeHostCache` (shared through a Mooncake master)."""

from .base import HostCache, HostObject, L2Stats, ObjectKind
from .local import LocalHostCache
from .mooncake import MooncakeConfig, MooncakeHostCache

__all__ = [
    "HostCache",
    "HostObject",
    "L2Stats",
    "LocalHostCache",
    "MooncakeConfig",
    "MooncakeHostCache",
    "ObjectKind",
]
