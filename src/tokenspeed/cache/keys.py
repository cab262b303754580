"""Chained page keys: equal keys mean equal prefixes.

The key of page i is a 128-bit hash of (key of page i-1, content of page i), so it names the whole
prefix [0, (i+1)*P), not just one page. Keys are plain Python ints (`tokenspeed.types.PageKey`);
they are identical in every process and on every machine, which lets a shared L2 find the pages and
checkpoints another engine published.

Content comes in two forms, and one page may mix them:

- token ids (the runtime): `KeyChain.append_tokens`;
- trace blocks (the simulator): aiperf / Mooncake traces give one `hash_id` per 512-token block,
  equal ids meaning equal content. `KeyChain.append_blocks` turns them into page keys. A page is
  described by the block pieces it covers, `(block id, first token in block, end token in block)`;
  with a block size that is a multiple of P (512 = 8 x 64), page j of block b is simply
  `(b, j*P, (j+1)*P)`, so a 512-token block spans 8 pages whose keys are chained like any others.
  A partial last block yields keys for its full pages only; the rest waits in the chain until the
  next content completes the page.

A chain is incremental: a growing request appends only its new content and never re-hashes its
history. Splitting the same content into different appends gives the same keys.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterable, Sequence

from ..types import PageKey
from .errors import CacheConfigError

_KEY_BYTES = 16
_BLOCK_PIECE = struct.Struct("<qII")
_ONE_PIECE = struct.Struct("<cqII")  # b"B" + _BLOCK_PIECE in one call
_COUNT = struct.Struct("<I")
_blake2b = hashlib.blake2b


def _chain(prev: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(prev + payload, digest_size=_KEY_BYTES).digest()


def _token_piece(tokens: Sequence[int]) -> bytes:
    # Length-prefixed so that no two different piece lists encode to the same bytes.
    return b"T" + _COUNT.pack(len(tokens)) + array("q", tokens).tobytes()


def key_to_int(digest: bytes) -> PageKey:
    return int.from_bytes(digest, "little")


def _encode(pieces: list[list]) -> bytes:
    """Payload of one page from its pieces (["t", tokens] or ["b", block_id, start, end])."""
    return b"".join(
        _token_piece(p[1]) if p[0] == "t" else _ONE_PIECE.pack(b"B", p[1], p[2], p[3])
        for p in pieces
    )


class KeyChain:
    """Page keys of one growing sequence.

    `keys[i]` is the key of page i (tokens [i*P, (i+1)*P)); only full pages have keys. `salt` starts
    the chain (use it to keep unrelated key spaces apart, e.g. two models or LoRA adapters).
    """

    __slots__ = ("_pending", "_pending_tokens", "_prev", "keys", "num_tokens", "page_size")

    def __init__(self, page_size: int, *, salt: bytes = b"") -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise CacheConfigError(f"page_size must be a positive integer, got {page_size!r}")
        self.page_size = page_size
        self.keys: list[PageKey] = []
        self.num_tokens = 0
        self._prev = hashlib.blake2b(b"tokenspeed-root" + salt, digest_size=_KEY_BYTES).digest()
        # Content of the current partial page: ["t", [tokens]] or ["b", block_id, start, end].
        self._pending: list[list] = []
        self._pending_tokens = 0

    def fork(self) -> KeyChain:
        """An independent copy (e.g. a branch of a conversation)."""
        other = KeyChain.__new__(KeyChain)
        other.page_size = self.page_size
        other.keys = list(self.keys)
        other.num_tokens = self.num_tokens
        other._prev = self._prev
        other._pending = [list(p) if p[0] == "b" else ["t", list(p[1])] for p in self._pending]
        other._pending_tokens = self._pending_tokens
        return other

    def append_tokens(self, tokens: Sequence[int]) -> list[PageKey]:
        """Append token ids; returns the keys of the pages this completed."""
        new: list[PageKey] = []
        i, n, size = 0, len(tokens), self.page_size
        if self._pending_tokens and n:
            take = min(size - self._pending_tokens, n)
            self._add_tokens(tokens[:take])
            i = take
            if self._pending_tokens == size:
                new.append(self._close_page())
        # Fast path: whole pages straight from the input.
        while n - i >= size:
            new.append(self._emit(_token_piece(tokens[i : i + size])))
            i += size
        if i < n:
            self._add_tokens(tokens[i:])
        self.num_tokens += n
        return new

    def append_blocks(
        self, block_ids: Sequence[int], num_tokens: int, block_size: int
    ) -> list[PageKey]:
        """Append `num_tokens` tokens described by consecutive trace blocks of `block_size` tokens
        (the last block may be partial); returns the keys of the pages this completed."""
        if block_size <= 0:
            raise CacheConfigError(f"block_size must be positive, got {block_size!r}")
        full, rest = divmod(num_tokens, block_size)
        if num_tokens < 0 or len(block_ids) != full + (1 if rest else 0):
            raise CacheConfigError(
                f"{len(block_ids)} block ids cannot describe {num_tokens} tokens in blocks of "
                f"{block_size}"
            )
        # One pass with the chain state in locals (a long history appends thousands of pages a
        # turn); the same pieces, merges and hashes as `_add_block` / `_close_page` / `_emit`.
        new: list[PageKey] = []
        size = self.page_size
        keys = self.keys
        prev = self._prev
        pending = self._pending
        pending_tokens = self._pending_tokens
        for b, block_id in enumerate(block_ids):
            length = block_size if b < full else rest
            start = 0
            block_id = int(block_id)
            while start < length:
                if not pending_tokens and length - start >= size:
                    # A whole page inside the block, nothing pending.
                    prev = _blake2b(
                        prev + _ONE_PIECE.pack(b"B", block_id, start, start + size),
                        digest_size=_KEY_BYTES,
                    ).digest()
                    key = int.from_bytes(prev, "little")
                    keys.append(key)
                    new.append(key)
                    start += size
                    continue
                end = start + min(size - pending_tokens, length - start)
                last = pending[-1] if pending else None
                if last is not None and last[0] == "b" and last[1] == block_id and last[3] == start:
                    last[3] = end  # the same block continued: one piece, whatever the split
                else:
                    pending.append(["b", block_id, start, end])
                pending_tokens += end - start
                start = end
                if pending_tokens == size:
                    prev = _blake2b(prev + _encode(pending), digest_size=_KEY_BYTES).digest()
                    key = int.from_bytes(prev, "little")
                    keys.append(key)
                    new.append(key)
                    pending = []
                    pending_tokens = 0
        self._prev = prev
        self._pending = pending
        self._pending_tokens = pending_tokens
        self.num_tokens += num_tokens
        return new

    def _add_tokens(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        if self._pending and self._pending[-1][0] == "t":
            self._pending[-1][1].extend(tokens)
        else:
            self._pending.append(["t", tokens])
        self._pending_tokens += len(tokens)

    def _add_block(self, block_id: int, start: int, end: int) -> None:
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == "b" and last[1] == block_id and last[3] == start:
            last[3] = end  # the same block continued: one piece, whatever the split
        else:
            self._pending.append(["b", block_id, start, end])
        self._pending_tokens += end - start

    def _close_page(self) -> PageKey:
        payload = _encode(self._pending)
        self._pending = []
        self._pending_tokens = 0
        return self._emit(payload)

    def _emit(self, payload: bytes) -> PageKey:
        self._prev = _chain(self._prev, payload)
        key = key_to_int(self._prev)
        self.keys.append(key)
        return key


def page_keys_for_tokens(tokens: Sequence[int], page_size: int, *, salt: bytes = b"") -> list:
    """Keys of the full pages of `tokens` (a one-shot `KeyChain`)."""
    return KeyChain(page_size, salt=salt).append_tokens(tokens)


def page_keys_for_blocks(
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    block_size: int,
    page_size: int,
    salt: bytes = b"",
) -> list:
    """Keys of the full pages of a sequence given as trace blocks (a one-shot `KeyChain`)."""
    return KeyChain(page_size, salt=salt).append_blocks(block_ids, num_tokens, block_size)
