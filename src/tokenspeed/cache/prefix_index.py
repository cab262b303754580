"""`PrefixIndex`: how much of a prompt is reusable, by the hybrid rule, across both tiers.

A prompt is looked up by the chained keys of its full pages (equal keys, equal prefixes). Its
reusable prefix is the longest L such that MLA pages cover [0, L) AND a KDA checkpoint exists at
exactly L: attention rows without the recurrent state at the same position are worth nothing to a
hybrid model. The walk: find each key's L1 page, ask the host tier for the pages L1 lacks (gap by
gap) to get the covered length, then take the deepest checkpoint (L1 or L2) inside it.

The index owns no state of its own: it reads the L1 page index (`MlaPageManager`), the L1
checkpoint index (`CheckpointManager`) and the host tier through `Tiering`. A `PrefixMatch`
records the versions it was computed against (its epoch), so that a match taken at lookup time
can be reused at admission when nothing changed in between instead of walking the keys again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..types import PageKey
from .checkpoints import CheckpointManager
from .errors import InvalidRequestError
from .handles import PrefixMatch
from .keys import KeyBuffer, PageKeys, as_page_keys, key_at
from .mla_pages import MlaPageManager
from .tiering import Tiering

# The sources of an empty hit (shared: read-only).
NO_SOURCES = np.zeros(0, dtype=np.int64)
NO_SOURCES.flags.writeable = False


def _is_count(value: object) -> bool:
    """A Python int that is not a bool (True is an int to Python, never a token count)."""
    return isinstance(value, int) and value.__class__ is not bool


class PrefixIndex:
    """Lookups of reusable prefixes over one rank's cache (see the module docstring).

    enabled: False turns prefix caching off (every match is empty). has_l2: whether a host tier
    is attached (a match against one that cannot report its version is never reused). owner:
    the manager's identity, stamped on matches so that a foreign match is never reused.
    """

    def __init__(
        self,
        pages: MlaPageManager,
        checkpoints: CheckpointManager,
        tiering: Tiering,
        *,
        page_size: int,
        enabled: bool,
        has_l2: bool,
        owner: object,
    ) -> None:
        self._pages = pages
        self._ckpts = checkpoints
        self._tiering = tiering
        self.page_size = page_size
        self.enabled = enabled
        self._has_l2 = has_l2
        self._owner = owner

    def epoch(self) -> tuple[int, int, int | None] | None:
        """What a match depends on: the L1 page and checkpoint indexes and the host tier's
        presence. None when the host tier cannot tell whether it changed (never reused)."""
        l2 = self._tiering.l2_version()
        if l2 is None and self._has_l2:
            return None
        return (self._pages.version, self._ckpts.version, l2)

    def match(
        self, page_keys: PageKeys | KeyBuffer | Sequence[PageKey], prompt_tokens: int
    ) -> PrefixMatch:
        """The longest reusable prefix of a prompt of `prompt_tokens` tokens with these page keys
        (more keys than full pages may be given; the hit leaves at least one token to compute).
        Changes nothing."""
        if not _is_count(prompt_tokens) or prompt_tokens < 1:
            raise InvalidRequestError(f"prompt_tokens must be >= 1, got {prompt_tokens!r}")
        P = self.page_size
        page_keys = as_page_keys(page_keys)
        limit = min(len(page_keys), (prompt_tokens - 1) // P)
        keys = page_keys[:limit]
        scope = (limit, key_at(keys, limit - 1) if limit else None)
        if limit <= 0 or not self.enabled:
            return PrefixMatch(
                num_tokens=0,
                l1_tokens=0,
                l2_tokens=0,
                checkpoint_tier=None,
                mla_covered_tokens=0,
                epoch=self.epoch(),
                owner=self._owner,
                scope=scope,
                sources=NO_SOURCES,
            )
        pids = self._pages.lookup_ids(keys)
        covered = self._tiering.coverage(keys, pids)
        best, tier = self._tiering.deepest_checkpoint(keys, covered)
        hit = best + 1
        sources = pids[:hit]
        from_l2 = int(np.count_nonzero(sources < 0))
        return PrefixMatch(
            num_tokens=hit * P,
            l1_tokens=(hit - from_l2) * P,
            l2_tokens=from_l2 * P,
            checkpoint_tier=tier,
            mla_covered_tokens=covered * P,
            epoch=self.epoch(),
            owner=self._owner,
            scope=scope,
            sources=sources,
        )

    def usable(
        self, match: PrefixMatch | None, page_keys: PageKeys, prompt_tokens: int
    ) -> PrefixMatch:
        """`match` if it is still this index's answer for this prompt (same owner, nothing
        changed since, same keys in scope); otherwise a fresh match."""
        if (
            match is not None
            and match.owner is self._owner
            and match.epoch is not None
            and match.epoch == self.epoch()
        ):
            limit = min(len(page_keys), (prompt_tokens - 1) // self.page_size)
            if match.scope == (limit, key_at(page_keys, limit - 1) if limit > 0 else None):
                return match
        return self.match(page_keys, prompt_tokens)
