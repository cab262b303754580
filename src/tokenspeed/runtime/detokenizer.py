"""Incremental detokenization: a request's output text kept step by step, each new token costing
the decode of a short window of ids instead of the whole output.

The text so far is `settled + tail`. `settled` is final: no later id changes it. `tail` is the
text of the ids after the read offset as a full decode renders it now, and may still change (an
incomplete UTF-8 sequence shows as U+FFFD until its last byte arrives; a byte-fallback piece
joins the pieces after it). Each update decodes ids[prefix:] and drops the known text of
ids[prefix:read], the context in front of the new ids; once the tail cannot change any more (it
does not end in U+FFFD, and its last id closes it) it joins `settled` and the offsets move up.
The scheme of vLLM's prefix and read offsets, held to one more promise: the text is exactly what
a full decode gives, at every step. What makes a window's text equal to its part of the whole is
the tokenizer's `WindowRule` (tokenizer.py); a tokenizer without one is decoded whole each time.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import Tokenizer, WindowRule

REPLACEMENT = "\ufffd"  # what a decode renders for an incomplete or bad UTF-8 sequence


class Detokenizer:
    """The text of one growing sequence of ids.

    Contract: `update(ids, end)` is called with sequences each extending the previous one (the
    same ids in front; a request's output ids), and afterwards `text` equals
    `tokenizer.decode(ids[:end])`, character for character. An exception of the tokenizer leaves
    the state as it was before the call.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._decode = tokenizer.decode
        self._rule: WindowRule | None = getattr(tokenizer, "window_rule", None)
        self.settled = ""  # the text of ids[:read]: final
        self.tail = ""  # the text of ids[read:end] as it reads now
        self.num_ids = 0  # ids seen: `end` of the last update
        self._prefix = 0  # ids[prefix:read] are decoded in front of the new ids, for context
        self._read = 0
        self._prefix_text = ""  # decode(ids[prefix:read])

    def __len__(self) -> int:
        return len(self.settled) + len(self.tail)

    @property
    def text(self) -> str:
        return self.settled + self.tail if self.tail else self.settled

    @property
    def incremental(self) -> bool:
        """False when every update decodes all the ids (no rule for the tokenizer)."""
        return self._rule is not None

    def text_from(self, start: int) -> str:
        """text[start:], without building the whole text."""
        cut = start - len(self.settled)
        if cut >= 0:
            return self.tail[cut:]
        return self.settled[start:] + self.tail

    def update(self, ids: Sequence[int], end: int | None = None) -> None:
        """Take in ids[:end] (all of them by default)."""
        end = len(ids) if end is None else end
        if end <= self.num_ids:
            if end < self.num_ids:
                raise ValueError(f"{end} ids after {self.num_ids}: the sequence only grows")
            return
        window = self._decode(ids[self._prefix : end])
        if not window.startswith(self._prefix_text):
            # The window's context decodes differently in front of the new ids: the tokenizer
            # breaks its rule. Stay exact: decode everything from now on.
            window = self._decode(ids[:end])
            self._rule, self._prefix, self._read, self._prefix_text = None, 0, 0, ""
            self.settled = ""
        tail = window[len(self._prefix_text) :]
        rule = self._rule
        if (
            rule is None
            or tail.endswith(REPLACEMENT)
            or (rule.closes is not None and not rule.closes(ids[end - 1]))
        ):
            self.tail, self.num_ids = tail, end
            return
        prefix, prefix_text = end, ""
        if rule.prefix:
            # The next window starts at the read offset if the text of ids[read:end] decoded
            # alone is not empty: then the decode's first-token handling (a leading space
            # dropped, a first character stripped) falls on the context, which is dropped.
            # Otherwise the context keeps its start and grows by the new ids.
            prefix = self._read
            same = prefix == self._prefix  # then ids[read:end] is the window itself
            prefix_text = window if same else self._decode(ids[prefix:end])
            if not prefix_text:
                prefix, prefix_text = self._prefix, window
        self.settled += tail
        self.tail, self.num_ids = "", end
        self._prefix, self._read, self._prefix_text = prefix, end, prefix_text
