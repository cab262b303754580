"""When a request's output ends: EOS, stop token ids, stop strings."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .detokenizer import Detokenizer
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

_UNSETTLED_CHARS = 3  # trailing characters of a decoded text that a later token may rewrite


class StopChecker:
    """Checks a request's output after each new token; also renders its text.

    EOS and stop token ids stay in token_ids but not in the text; a stop string ends the output
    and is cut from the text. Both keep the text incrementally (`Detokenizer`): a step decodes
    the new tokens and a few before them, not the whole output.

    min_tokens (as vLLM): nothing ends the first min_tokens tokens of the output; a stop string
    then counts only where it ends in the text of a later token (it may start before), and the
    text is cut at the first such occurrence, not at one inside the first tokens' text.
    """

    def __init__(
        self, params: SamplingParams, tokenizer: Tokenizer | None, eos_token_ids: Sequence[int]
    ):
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._checked_len = 0  # length of the text at the previous check
        self._checked_settled = 0  # length of the detokenizer's settled text then
        self._detok = Detokenizer(tokenizer) if tokenizer is not None else None
        # Where each stop string first occurs in the settled text (None: nowhere), searched up
        # to `_searched` characters; the settled text never changes, so this is never redone.
        self._in_settled: dict[str, int | None] = dict.fromkeys(params.stop)
        self._searched = 0
        self._min_tokens = params.min_tokens
        # min_tokens: a stop string counts only where it ends past this index of the text (the
        # length of the text of the first min_tokens tokens).
        self._floor = 0

    def check(self, output_ids: Sequence[int]) -> str | int | None:
        """The stop reason (a token id or a stop string) if the output just ended, else None.
        Called once per new token, in order."""
        if len(output_ids) <= self._min_tokens:
            if self.params.stop:  # follow the text, so that later checks start past it
                detok = self._detok
                detok.update(output_ids)
                self._checked_len, self._checked_settled = len(detok), len(detok.settled)
                self._floor = len(detok)
            return None
        last = output_ids[-1]
        if last in self.stop_ids:
            return last
        if self.params.stop:
            detok = self._detok
            detok.update(output_ids)
            # A stop string completed by this token ends in the text it added, however long
            # (one token can be many characters), or in earlier text that the token rewrote.
            # Only the detokenizer's unsettled tail can be rewritten: an incomplete UTF-8
            # sequence decodes to up to 3 replacement characters until its last byte arrives,
            # and a byte-fallback run of any length turns from one U+FFFD per byte into the
            # (fewer) characters it spells, so the text can even get shorter. Settled text
            # never changes, unless the detokenizer just gave up windows (settled is then "").
            # The previous bound (the last 3 characters of the previous text) stays a floor.
            known = min(self._checked_len - _UNSETTLED_CHARS, self._checked_settled)
            known = min(known, len(detok.settled))
            start = max(0, known - self._longest_stop + 1)
            self._checked_len, self._checked_settled = len(detok), len(detok.settled)
            tail = detok.text_from(start)
            floor = self._floor
            for stop in self.params.stop:
                if floor:
                    if tail.find(stop, max(0, floor - len(stop) + 1 - start)) >= 0:
                        return stop
                elif stop in tail:
                    return stop
        return None

    def text(self, output_ids: Sequence[int]) -> str:
        """The output's text: a final stop token id left out, cut where a stop string starts
        (the stop strings taken in order, each cutting what the ones before it left)."""
        end = len(output_ids)
        if end > self._min_tokens and output_ids[-1] in self.stop_ids:
            end -= 1
        self._detok.update(output_ids, end)
        text = self._detok.text
        if end <= self._min_tokens:  # no stop string cuts the first min_tokens tokens' text
            return text
        limit = len(text)
        for stop, at in self._first_stops():
            # A string's first occurrence in text[:limit], if any, is its first in the text.
            if at is not None and at + len(stop) <= limit:
                limit = at
        return text if limit == len(text) else text[:limit]

    def _first_stops(self) -> Iterator[tuple[str, int | None]]:
        """Each stop string with the index of its first occurrence in the text (None: none)."""
        settled, tail = self._detok.settled, self._detok.tail
        floor = self._floor  # occurrences must end past it (min_tokens), so start from here on
        if len(settled) < self._searched:  # the detokenizer fell back to full decodes
            self._in_settled, self._searched = dict.fromkeys(self.params.stop), 0
        if len(settled) > self._searched:
            for stop, at in self._in_settled.items():
                if at is None:
                    lo = max(0, self._searched - len(stop) + 1, floor - len(stop) + 1)
                    found = settled.find(stop, lo)
                    self._in_settled[stop] = found if found >= 0 else None
            self._searched = len(settled)
        for stop, at in self._in_settled.items():
            if at is None and tail:  # one that ends in the tail, which may still change
                edge = max(0, len(settled) - len(stop) + 1, floor - len(stop) + 1)
                base = min(edge, len(settled))
                found = (settled[base:] + tail).find(stop, edge - base)
                at = base + found if found >= 0 else None
            yield stop, at
