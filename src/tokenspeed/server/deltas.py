"""`ChoiceDelta`: what one streamed choice sends next, from the engine's cumulative outputs.

The engine hands back a choice's whole text and token ids at every step; a stream sends only
what is new. Text is held back where a later token may still change it: trailing U+FFFD (an
incomplete UTF-8 sequence renders so until its last byte arrives) and, with stop strings, the
last `len(longest stop) - 1` characters (a stop string completed later is cut from the text,
with whatever of it came before). The final output releases everything. Token ids are never
held back: `token_ids` deltas (return_token_ids) follow the engine exactly.
"""

from __future__ import annotations

import logging

from tokenspeed.runtime.outputs import CompletionOutput

logger = logging.getLogger("tokenspeed.server")

REPLACEMENT = "\ufffd"
_EDGE = 8  # characters of what was sent that are checked against each new text


class ChoiceDelta:
    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._sent = 0  # characters of text sent
        self._edge = ""  # the last characters sent
        self._ids = 0  # token ids sent
        self._warned = False

    def next(self, completion: CompletionOutput, final: bool) -> tuple[str, list[int]]:
        """(new text, new token ids) to send for this output of the choice."""
        ids = completion.token_ids
        new_ids = ids[self._ids :]
        self._ids = len(ids)
        text = completion.text
        sent = self._sent
        end = len(text)
        if not final:
            while end > sent and text[end - 1] == REPLACEMENT:
                end -= 1
            end -= self._hold
        if end <= sent:
            return "", new_ids
        if self._edge and not self._warned and text[sent - len(self._edge) : sent] != self._edge:
            # Text already sent changed after all (a tokenizer rewriting more than its tail):
            # it cannot be taken back; the stream goes on from the same length.
            logger.warning("a streamed text changed after it was sent; continuing from it")
            self._warned = True
        delta = text[sent:end]
        self._sent = end
        self._edge = text[max(end - _EDGE, 0) : end]
        return delta, new_ids
