"""When a request's output ends: EOS, stop token ids, stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


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

    def check(self, output_ids: Sequence[int]) -> str | int | None:
        """The stop reason (a token id or a stop string) if the output just ended, else None."""
        last = output_ids[-1]
        if last in self.stop_ids:
            return last
        if self.params.stop:
            text = self.tokenizer.decode(output_ids)
            # Only the tail can hold a stop string completed by this token.
            tail = text[-(self._longest_stop + 16) :]
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
