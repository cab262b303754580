"""`ChoiceDelta`: streamed text never sends what a later token may change."""

from tokenspeed.runtime.outputs import CompletionOutput
from tokenspeed.server.deltas import ChoiceDelta


def seq(text: str, n: int) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=list(range(n)))


def test_an_incomplete_utf8_tail_waits_for_its_last_byte():
    d = ChoiceDelta()
    assert d.next(seq("ab\ufffd", 3), False) == ("ab", [0, 1, 2])
    assert d.next(seq("ab\ufffd\ufffd", 4), False) == ("", [3])
    assert d.next(seq("ab€", 5), False) == ("€", [4])
    assert d.next(seq("ab€\ufffd", 6), True) == ("\ufffd", [5])  # the end releases it all


def test_stop_strings_hold_back_their_length_minus_one():
    d = ChoiceDelta(stop=("END", "x"))
    assert d.next(seq("hello", 1), False) == ("hel", [0])
    assert d.next(seq("hello E", 2), False) == ("lo", [1])
    assert d.next(seq("hello EN", 3), False) == (" ", [2])
    assert d.next(seq("hello ", 4), True) == ("", [3])  # "END" was cut: nothing of it was sent
    d = ChoiceDelta(stop=("END",))
    d.next(seq("hello", 1), False)
    assert d.next(seq("hello world", 2), True) == ("lo world", [1])
