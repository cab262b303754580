"""The engine's side of one request: the checks it must pass, its tokens, and its outputs."""

from __future__ import annotations

import operator
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import overload

import attrs

from tokenspeed.cache import KeyChain
from tokenspeed.sched import Request

from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .stop import StopChecker


class RequestError(ValueError):
    """A request the engine cannot take; raised before any work starts for it."""


def check_prompt(
    request_id: Hashable,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    has_tokenizer: bool,
) -> list[int]:
    """The prompt as a list of ints, or RequestError when the engine cannot serve it."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"request {request_id!r}: params must be SamplingParams")
    try:  # ints, numpy ints, one-element integer tensors; not floats or strings
        ids = [operator.index(t) for t in prompt_token_ids]
    except TypeError:
        raise RequestError(
            f"request {request_id!r}: prompt token ids must be a sequence of integers"
        ) from None
    if not ids:
        raise RequestError(f"request {request_id!r}: the prompt is empty")
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise RequestError(
            f"request {request_id!r}: token ids {bad[:8]} are outside the vocabulary "
            f"[0, {vocab_size})"
        )
    if len(ids) >= max_model_len:
        raise RequestError(
            f"request {request_id!r}: prompt of {len(ids)} tokens leaves no room under "
            f"max_model_len={max_model_len}"
        )
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise RequestError(
            f"request {request_id!r}: logprobs={params.logprobs} exceeds the vocabulary "
            f"({vocab_size} tokens)"
        )
    if params.stop and not has_tokenizer:
        raise RequestError(f"request {request_id!r}: stop strings need a tokenizer")
    if params.n != 1:
        # n completions are n requests (sharing the prompt's cached prefix): `LLM.generate`
        # adds them and merges their outputs; an engine request is one completion.
        raise RequestError(
            f"request {request_id!r}: n={params.n}, but an engine request is one completion; "
            "add n requests (as LLM.generate does)"
        )
    return ids


class TokenTail(Sequence[int]):
    """`tokens[start:]` of a list that only grows, read in place: length and indexing cost
    O(1), and only a slice copies (just the slice)."""

    __slots__ = ("_start", "_tokens")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens = tokens
        self._start = start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            rows = range(len(self))[i]
            if rows.step == 1:
                return self._tokens[self._start + rows.start : self._start + rows.stop]
            return [self._tokens[self._start + k] for k in rows]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("token index out of range")
        return self._tokens[self._start + (i if i >= 0 else n + i)]

    def __iter__(self) -> Iterator[int]:
        tokens = self._tokens
        return (tokens[k] for k in range(self._start, len(tokens)))


@attrs.define(eq=False)
class RequestRecord:
    """One request's tokens, keys, logprobs and outcome.

    `tokens` is the request's whole history, prompt then outputs, one list that only grows
    (`append`): the forwards slice their inputs out of it. `output_ids` reads its outputs in
    place; `prompt_ids` is the prompt as the outputs report it (never mutated)."""

    rid: Hashable
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    sched: Request
    chain: KeyChain
    stop: StopChecker
    metrics: RequestMetrics
    tokens: list[int] = attrs.field(init=False)
    output_ids: TokenTail = attrs.field(init=False)
    logprobs: list[float] = attrs.Factory(list)
    top_logprobs: list[list[tuple[int, float]]] = attrs.Factory(list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    abort_reason: str | None = None

    def __attrs_post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        self.output_ids = TokenTail(self.tokens, len(self.prompt_ids))

    def append(self, token: int) -> None:
        """A new output token: it extends the history and the page keys."""
        self.tokens.append(token)
        self.chain.append_tokens([token])

    def finish(self, reason: str, abort_reason: str | None = None) -> None:
        """End the request (an abort overrides an earlier reason)."""
        if self.finish_reason is None or reason == "abort":
            self.finish_reason = reason
        self.abort_reason = abort_reason
        self.metrics.finished_time = time.monotonic()

    def output(self, text: str) -> RequestOutput:
        """The request's output so far, with `text` the rendering of its output tokens."""
        want_logprobs = self.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=self.output_ids[:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if want_logprobs else None,
            top_logprobs=list(self.top_logprobs) if want_logprobs else None,
        )
        finished = self.finish_reason is not None
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=self.rid,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=[completion],
            finished=finished,
            metrics=self.metrics,
            abort_reason=self.abort_reason,
        )
