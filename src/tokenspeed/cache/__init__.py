"""tokenspeed.cache: the two-tier cache of hybrid KDA / MLA models.

Device tier: pages of MLA latent rows, one live KDA state slot per running request, and KDA
checkpoints at page-aligned prefix lengths. Host tier (L2): pages and checkpoints in host memory,
embedded (`LocalHostCache`) or shared through Mooncake (`MooncakeHostCache`). A prefix is reusable
up to the deepest checkpoint its pages cover (the hybrid rule). See docs/cache.md.
"""

from .checkpoints import CheckpointKind
from .config import CacheConfig, CacheGeometry, CheckpointPolicy, PoolSizes
from .errors import (
    BudgetTooSmallError,
    CacheConfigError,
    CacheError,
    CacheFullError,
    DuplicateRequestError,
    ForeignHandleError,
    IntegrityError,
    InvalidRequestError,
    RequestReleasedError,
    TransferError,
)
from .events import CompletionEvent
from .handles import PrefixMatch, RequestCache
from .keys import KeyChain, page_keys_for_blocks, page_keys_for_tokens
from .l2 import HostCache, L2Stats, LocalHostCache, MooncakeConfig, MooncakeHostCache, ObjectKind
from .load_handle import LoadHandle
from .manager import CacheManager
from .stats import CacheCounters, CacheStats, Occupancy

__all__ = [
    "BudgetTooSmallError",
    "CacheConfig",
    "CacheConfigError",
    "CacheCounters",
    "CacheError",
    "CacheFullError",
    "CacheGeometry",
    "CacheManager",
    "CacheStats",
    "CheckpointKind",
    "CheckpointPolicy",
    "CompletionEvent",
    "DuplicateRequestError",
    "ForeignHandleError",
    "HostCache",
    "IntegrityError",
    "InvalidRequestError",
    "KeyChain",
    "L2Stats",
    "LoadHandle",
    "LocalHostCache",
    "MooncakeConfig",
    "MooncakeHostCache",
    "ObjectKind",
    "Occupancy",
    "PoolSizes",
    "PrefixMatch",
    "RequestCache",
    "RequestReleasedError",
    "TransferError",
    "page_keys_for_blocks",
    "page_keys_for_tokens",
]
