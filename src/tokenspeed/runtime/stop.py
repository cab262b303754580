"""When a request's output ends: EOS, stop token ids, stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from .sampling_params import SamplingParams
from .tokenizer import Tokenizer

_UNSETTLED_CHARS = 3  # trailing characters of a decoded text that a later token may rewrite


class StopChecker:
    """Checks a request's output after each new token; also renders its text.

    EOS and stop token ids stay in token_ids but not in the text; a stop string ends the output
    and is cut from the text.
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

    def check(self, output_ids: Sequence[int]) -> str | int | None:
        """The stop reason (a token id or a stop string) if the output just ended, else None.
        Called once per new token, in order."""
        last = output_ids[-1]
        if last in self.stop_ids:
            return last
        if self.params.stop:
            text = self.tokenizer.decode(output_ids)
            # A stop string completed by this token ends in the text it added, however long
            # (one token can be many characters). The previous text's last few characters may
            # change too: an incomplete UTF-8 sequence decodes to up to 3 replacement
            # characters until its last byte arrives.
            start = max(0, self._checked_len - _UNSETTLED_CHARS - self._longest_stop + 1)
            self._checked_len = len(text)
            tail = text[start:]
            for stop in self.params.stop:
                if stop in tail:
                    return stop
        return None

    def text(self, output_ids: Sequence[int]) -> str:
        ids = list(output_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        for stop in self.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return text
