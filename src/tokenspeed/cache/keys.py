"""Chained page keys: equal keys mean equal prefixes.

The key of page i is a 128-bit hash of (key of page i-1, content of page i), so it names the whole
prefix [0, (i+1)*P), not just one page. Keys are identical in every process and on every machine,
which lets a shared L2 find the pages and checkpoints another engine published.

Representation: a sequence of keys is a `PageKeys` array, [n] of `KEY_DTYPE` (the 16 digest bytes
as two little-endian uint64 words, "lo" then "hi"), so that a history of thousands of pages is
compared, copied and looked up in whole-array steps and compiled loops, never one Python object at
a time. One key on its own is a `PageKey`, the same 128 bits as a Python int (`key_int`), for
dictionaries and messages. A growing sequence (a running request's chain) is a `KeyBuffer`.

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
import operator
import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import TypeAlias

import numpy as np

from ..types import PageKey
from .errors import CacheConfigError

KEY_DTYPE = np.dtype([("lo", "<u8"), ("hi", "<u8")])
"""One page key: the 16 bytes of its digest as two little-endian words."""

PageKeys: TypeAlias = np.ndarray
"""[n] `KEY_DTYPE`: the keys of n consecutive (or otherwise listed) pages."""

_KEY_BYTES = 16
_BLOCK_PIECE = struct.Struct("<qII")
_ONE_PIECE = struct.Struct("<cqII")  # b"B" + _BLOCK_PIECE in one call
_COUNT = struct.Struct("<I")
_blake2b = hashlib.blake2b
_NO_KEYS = np.zeros(0, dtype=KEY_DTYPE)
_NO_KEYS.flags.writeable = False


# ------------------------------------------------------------------------------ conversions
def key_int(key: np.void) -> PageKey:
    """One element of a `PageKeys` array as a Python int (lo + hi * 2^64)."""
    return int.from_bytes(key.tobytes(), "little")


def key_at(keys: PageKeys | KeyBuffer, i: int) -> PageKey:
    """keys[i] as a Python int."""
    if isinstance(keys, KeyBuffer):
        return keys[i]
    return key_int(keys[i])


def as_key_int(key: PageKey | np.void) -> PageKey:
    """One key as a Python int, whether given as an int or as an element of a `PageKeys`."""
    if isinstance(key, np.void):
        if key.dtype != KEY_DTYPE:
            raise CacheConfigError(f"not a page key: {key!r}")
        return key_int(key)
    try:
        # A numpy integer becomes an int (it has no to_bytes); a bool is no key.
        value = operator.index(key) if not isinstance(key, bool) else None
    except TypeError:
        value = None
    if value is None or not 0 <= value < 1 << 128:
        raise CacheConfigError(f"page keys must be integers in [0, 2^128), got {key!r}")
    return value


def _key_bytes(key: PageKey | np.void) -> bytes:
    if isinstance(key, np.void) and key.dtype == KEY_DTYPE:
        return key.tobytes()
    return as_key_int(key).to_bytes(_KEY_BYTES, "little")


def key_array(key: PageKey | np.void) -> PageKeys:
    """[1] `KEY_DTYPE`: one key as a `PageKeys` array."""
    key = as_key_int(key)
    out = np.empty(1, dtype=KEY_DTYPE)
    out[0] = (key & 0xFFFF_FFFF_FFFF_FFFF, key >> 64)
    return out


def keys_from_ints(ints: Iterable[PageKey | np.void]) -> PageKeys:
    """[n] `KEY_DTYPE` from Python ints in [0, 2^128) (or elements of other `PageKeys`)."""
    raw = b"".join(map(_key_bytes, ints))
    return np.frombuffer(raw, dtype=KEY_DTYPE).copy() if raw else np.zeros(0, dtype=KEY_DTYPE)


def keys_to_ints(keys: PageKeys | KeyBuffer) -> list[PageKey]:
    """The keys as Python ints (tests, messages; not for hot paths)."""
    arr = as_page_keys(keys)
    raw = arr.tobytes()
    return [
        int.from_bytes(raw[i : i + _KEY_BYTES], "little") for i in range(0, len(raw), _KEY_BYTES)
    ]


def as_page_keys(keys: PageKeys | KeyBuffer | Iterable[int]) -> PageKeys:
    """The `PageKeys` array of any key sequence: arrays pass through, a `KeyBuffer` gives a view
    of its current keys, anything else is read as Python ints (a slow path for callers that
    build a few keys by hand)."""
    if type(keys) is np.ndarray and (keys.dtype is KEY_DTYPE or keys.dtype == KEY_DTYPE):
        return keys
    if isinstance(keys, KeyBuffer):
        return keys.array
    return keys_from_ints(keys)


def keys_equal(a: PageKeys | KeyBuffer, b: PageKeys | KeyBuffer) -> bool:
    """Whether two key sequences are the same keys in the same order."""
    a, b = as_page_keys(a), as_page_keys(b)
    return len(a) == len(b) and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------------------ the buffer
class KeyBuffer:
    """A growable `PageKeys` array (appends amortised; `array` and slices are views).

    Indexing with an int gives that key as a Python int; with a slice, a `PageKeys` view. Views
    stay valid and unchanged after later appends (keys are never rewritten, and a grown buffer
    is a new array).
    """

    __slots__ = ("_buf", "_n", "_owned")

    def __init__(self, keys: PageKeys | None = None, *, capacity: int = 0) -> None:
        n = 0 if keys is None else len(keys)
        self._buf = np.empty(max(n, capacity, 16), dtype=KEY_DTYPE)
        if n:
            self._buf[:n] = keys
        self._buf.flags.writeable = False  # so that every view handed out is read-only
        self._n = n
        self._owned = True

    @classmethod
    def over(cls, keys: PageKeys) -> KeyBuffer:
        """A buffer that starts as `keys` itself, copied only when it first grows. Only for a
        read-only array (a chain's keys are never rewritten); a writeable one is copied now, so
        that its owner cannot change the buffer's keys later."""
        if keys.flags.writeable:
            return cls(keys)
        buf = cls.__new__(cls)
        buf._buf = keys
        buf._n = len(keys)
        buf._owned = False
        return buf

    def __len__(self) -> int:
        return self._n

    @property
    def array(self) -> PageKeys:
        """The keys so far ([n] `KEY_DTYPE`, a read-only view)."""
        return self._buf[: self._n]

    def __getitem__(self, i: int | slice) -> PageKey | PageKeys:
        if isinstance(i, slice):
            return self.array[i]
        n = self._n
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"key {i} of {n}")
        return key_int(self._buf[j])

    def __iter__(self):
        return iter(keys_to_ints(self.array))

    def extend(self, keys: PageKeys | KeyBuffer | Iterable[int]) -> None:
        keys = as_page_keys(keys)
        n, k = self._n, len(keys)
        if not k:
            return
        buf = self._buf
        if n + k > len(buf) or not self._owned:
            buf = np.empty(max(2 * len(buf), n + k, 16), dtype=KEY_DTYPE)
            buf[:n] = self._buf[:n]
            self._buf = buf
            self._owned = True
        buf.flags.writeable = True
        buf[n : n + k] = keys
        buf.flags.writeable = False
        self._n = n + k

    def copy(self) -> KeyBuffer:
        return KeyBuffer(self.array, capacity=len(self._buf))  # owned: it may grow at once

    def tolist(self) -> list[PageKey]:
        return keys_to_ints(self.array)

    def __repr__(self) -> str:
        return f"KeyBuffer({self._n} keys)"


# ---------------------------------------------------------------------------------- hashing
def _chain(prev: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(prev + payload, digest_size=_KEY_BYTES).digest()


def _token_piece(tokens: Sequence[int]) -> bytes:
    # Length-prefixed so that no two different piece lists encode to the same bytes.
    return b"T" + _COUNT.pack(len(tokens)) + array("q", tokens).tobytes()


def _encode(pieces: list[list]) -> bytes:
    """Payload of one page from its pieces (["t", tokens] or ["b", block_id, start, end])."""
    return b"".join(
        _token_piece(p[1]) if p[0] == "t" else _ONE_PIECE.pack(b"B", p[1], p[2], p[3])
        for p in pieces
    )


def _as_keys(digests: list[bytes]) -> PageKeys:
    """The `PageKeys` of consecutive digests (their bytes are the keys' bytes)."""
    if not digests:
        return _NO_KEYS
    return np.frombuffer(b"".join(digests), dtype=KEY_DTYPE)


class KeyChain:
    """Page keys of one growing sequence.

    `keys[i]` is the key of page i (tokens [i*P, (i+1)*P)); only full pages have keys. `keys` is
    the chain's `KeyBuffer` (it grows with the chain). `salt` starts the chain (use it to keep
    unrelated key spaces apart, e.g. two models or LoRA adapters).
    """

    __slots__ = ("_pending", "_pending_tokens", "_prev", "keys", "num_tokens", "page_size")

    def __init__(self, page_size: int, *, salt: bytes = b"") -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise CacheConfigError(f"page_size must be a positive integer, got {page_size!r}")
        self.page_size = page_size
        self.keys = KeyBuffer()
        self.num_tokens = 0
        self._prev = hashlib.blake2b(b"tokenspeed-root" + salt, digest_size=_KEY_BYTES).digest()
        # Content of the current partial page: ["t", [tokens]] or ["b", block_id, start, end].
        self._pending: list[list] = []
        self._pending_tokens = 0

    def fork(self) -> KeyChain:
        """An independent copy (e.g. a branch of a conversation)."""
        other = KeyChain.__new__(KeyChain)
        other.page_size = self.page_size
        other.keys = self.keys.copy()
        other.num_tokens = self.num_tokens
        other._prev = self._prev
        other._pending = [list(p) if p[0] == "b" else ["t", list(p[1])] for p in self._pending]
        other._pending_tokens = self._pending_tokens
        return other

    def append_tokens(self, tokens: Sequence[int]) -> PageKeys:
        """Append token ids; returns the keys of the pages this completed."""
        new: list[bytes] = []
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
        keys = _as_keys(new)
        self.keys.extend(keys)
        return keys

    def append_blocks(self, block_ids: Sequence[int], num_tokens: int, block_size: int) -> PageKeys:
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
        # turn). Pieces of one block that meet are merged, so any split gives the same keys.
        new: list[bytes] = []
        size = self.page_size
        prev = self._prev
        pending = self._pending
        pending_tokens = self._pending_tokens
        pack = _ONE_PIECE.pack
        whole = range(0, block_size, size) if block_size % size == 0 else None
        for b, block_id in enumerate(block_ids):
            length = block_size if b < full else rest
            start = 0
            block_id = int(block_id)
            if whole is not None and b < full and not pending_tokens:
                # A whole block of whole pages, nothing pending (the common case): the pages'
                # pieces straight from the block id.
                for start in whole:
                    prev = _blake2b(
                        prev + pack(b"B", block_id, start, start + size), digest_size=_KEY_BYTES
                    ).digest()
                    new.append(prev)
                continue
            while start < length:
                if not pending_tokens and length - start >= size:
                    # A whole page inside the block, nothing pending.
                    prev = _blake2b(
                        prev + _ONE_PIECE.pack(b"B", block_id, start, start + size),
                        digest_size=_KEY_BYTES,
                    ).digest()
                    new.append(prev)
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
                    new.append(prev)
                    pending = []
                    pending_tokens = 0
        self._prev = prev
        self._pending = pending
        self._pending_tokens = pending_tokens
        self.num_tokens += num_tokens
        keys = _as_keys(new)
        self.keys.extend(keys)
        return keys

    def _add_tokens(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        if self._pending and self._pending[-1][0] == "t":
            self._pending[-1][1].extend(tokens)
        else:
            self._pending.append(["t", tokens])
        self._pending_tokens += len(tokens)

    def _close_page(self) -> bytes:
        payload = _encode(self._pending)
        self._pending = []
        self._pending_tokens = 0
        return self._emit(payload)

    def _emit(self, payload: bytes) -> bytes:
        self._prev = _chain(self._prev, payload)
        return self._prev


def page_keys_for_tokens(tokens: Sequence[int], page_size: int, *, salt: bytes = b"") -> PageKeys:
    """Keys of the full pages of `tokens` (a one-shot `KeyChain`)."""
    return KeyChain(page_size, salt=salt).append_tokens(tokens)


def page_keys_for_blocks(
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    block_size: int,
    page_size: int,
    salt: bytes = b"",
) -> PageKeys:
    """Keys of the full pages of a sequence given as trace blocks (a one-shot `KeyChain`)."""
    return KeyChain(page_size, salt=salt).append_blocks(block_ids, num_tokens, block_size)
