"""The layout of one packed forward step: which tokens belong to which request."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import accumulate

import attrs
import torch


class BatchError(ValueError):
    """A forward step whose inputs do not describe a valid packed batch."""


def as_int(value: object, name: str, error: type[Exception] = BatchError) -> int:
    """`value` as an int when it is an integer (Python, NumPy, or a one-element integer tensor).

    int() would truncate a float (2.7 -> 2), parse a string and take True for 1: each a caller's
    mistake that would pass as a wrong length. operator.index refuses the first two; bools are
    ints to Python (and a bool tensor converts), so they are refused by name.
    """
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise error(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise error(f"{name} must be an integer, got {value!r}") from None


def _int_tuple(values: Iterable[int], name: str) -> tuple[int, ...]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise BatchError(f"{name} must be a sequence of integers, got {values!r}")
    return tuple(as_int(n, f"{name}[{i}]") for i, n in enumerate(values))


@attrs.frozen(eq=False)
class ForwardBatch:
    """A packed batch of B requests and T new tokens.

    Request i owns tokens cu_seqlens[i]:cu_seqlens[i+1] of the step (seq_lens[i] of them) and
    already has prefix_lens[i] tokens in its state. The same layout serves full prefill
    (prefix 0), extension of a cached prefix, decode (1 new token) and verification (a few).
    B may be 0: a rank with no requests in a step still runs the forward over 0 tokens (so the
    collectives inside parallel layers line up across ranks); a request with 0 new tokens is
    refused.

    The tensor fields are all a CUDA graph needs: a graph runner builds one batch over static
    buffers (`prefix_lens=None`, since the prefixes change between replays) and refills them.
    """

    seq_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...] | None
    cu_seqlens: torch.Tensor  # [B + 1] int64
    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    token_request: torch.Tensor  # [T] int64, the request each token belongs to
    context_lens: torch.Tensor  # [B] int64, tokens in each request's state after the step
    # Per-step attention metadata a kernel may use (the MLA decode split plan); None: kernels
    # plan for themselves.
    attn_plan: object | None = None

    @classmethod
    def build(
        cls,
        seq_lens: Sequence[int],
        prefix_lens: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> ForwardBatch:
        seq_lens = _int_tuple(seq_lens, "seq_lens")
        prefix_lens = (
            (0,) * len(seq_lens) if prefix_lens is None else _int_tuple(prefix_lens, "prefix_lens")
        )
        if len(prefix_lens) != len(seq_lens):
            raise BatchError(
                f"{len(seq_lens)} seq_lens but {len(prefix_lens)} prefix_lens; need one each"
            )
        empty = [i for i, n in enumerate(seq_lens) if n <= 0]
        if empty:
            raise BatchError(f"requests {empty} have no new tokens; empty sequences are invalid")
        negative = [i for i, n in enumerate(prefix_lens) if n < 0]
        if negative:
            raise BatchError(f"requests {negative} have negative prefix lengths")
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        prefix = torch.tensor(prefix_lens, dtype=torch.int64)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        cu[1:] = lens.cumsum(0)
        offsets = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lens)
        return cls(
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            cu_seqlens=cu.to(device),
            positions=(torch.repeat_interleave(prefix, lens) + offsets).to(device),
            token_request=torch.repeat_interleave(torch.arange(len(seq_lens)), lens).to(device),
            context_lens=(prefix + lens).to(device),
        )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def total_lens(self) -> tuple[int, ...]:
        """Tokens in each request's state after this step (host copy of context_lens)."""
        if self.prefix_lens is None:
            return tuple(self.context_lens.tolist())
        return tuple(p + n for p, n in zip(self.prefix_lens, self.seq_lens, strict=True))

    @property
    def uniform_len(self) -> int | None:
        """The common number of new tokens when every request has the same, else None (also
        for a batch of no requests, which has no common length: it takes the per-request
        paths, whose loops run zero times)."""
        lengths = set(self.seq_lens)
        return lengths.pop() if len(lengths) == 1 else None

    @property
    def last_token_indices(self) -> torch.Tensor:
        """[B] index of each request's last new token in the packed step."""
        return self.cu_seqlens[1:] - 1

    @property
    def cu_seqlens_host(self) -> torch.Tensor:
        """[B + 1] int64 on the host: `cu_seqlens` from `seq_lens`, without reading the device
        (a read would wait for every kernel queued before it)."""
        return torch.tensor((0, *accumulate(self.seq_lens)), dtype=torch.int64)

    def segments(self):
        """(request index, slice of the packed tokens) pairs (from `seq_lens`: no device read)."""
        start = 0
        for i, n in enumerate(self.seq_lens):
            yield i, slice(start, start + n)
            start += n
