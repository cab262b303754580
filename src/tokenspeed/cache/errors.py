"""Typed exceptions of the cache.

Every error raised by a `CacheManager` operation is a `CacheError`, raised before any pool is
changed (or after the operation has been rolled back), so the caller may catch it and go on with a
consistent cache. L2 failures are never raised: they degrade to misses and dropped writes and show
up in `CacheStats`.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class of everything the cache raises on purpose."""


class CacheConfigError(CacheError, ValueError):
    """A geometry or configuration value is invalid; the message names the field."""


class BudgetTooSmallError(CacheConfigError):
    """The memory budget cannot hold even one request (at construction), or a request needs more
    pages than the whole pool holds (at allocate / extend), so waiting would never help."""


class CacheFullError(CacheError):
    """Not enough free or evictable capacity right now; the request may succeed later, after
    other requests release their cache. Nothing was changed."""


class InvalidRequestError(CacheError, ValueError):
    """Arguments that contradict the request's state (an unaligned checkpoint length, a length
    beyond the reserved tokens, a shrinking extend, ...)."""


class DuplicateRequestError(InvalidRequestError):
    """`allocate` was called with the id of a request that still holds cache."""


class RequestReleasedError(InvalidRequestError):
    """The handle was already released (released twice, or used after release)."""


class ForeignHandleError(InvalidRequestError):
    """The handle was created by a different `CacheManager`."""


class TransferError(CacheError):
    """An asynchronous copy into the device tier failed; the affected pages were not trusted."""


class IntegrityError(CacheError, AssertionError):
    """The cache's bookkeeping is inconsistent: a bug in the cache, never the caller's fault.
    Raised by `check_integrity()` and by internal guards."""
