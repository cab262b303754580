"""Stop strings through the engine, with tokenizers whose tokens are long runs of text."""

import pytest

from tokenspeed.runtime import Engine, EngineConfig, SamplingParams
from tokenspeed.runtime.stop import StopChecker

from .conftest import reference, tokens


class LongTokens:
    """Token t renders as "<t>" followed by 40 dots: a stop string ending a token's text sits
    far from the end of the text, as "\\n" does in a code vocabulary's newline + indent token."""

    eos_token_ids = ()

    def encode(self, text):
        raise NotImplementedError

    def decode(self, ids):
        return "".join(f"<{i}>" + "." * 40 for i in ids)


def test_a_stop_string_far_from_the_end_of_a_long_token_ends_the_output(tiny):
    prompt = tokens(17, seed=4)
    want = reference(tiny, prompt, 6)
    stop = f"<{want[2]}>"
    assert stop not in LongTokens().decode(want[:2])  # the third token brings it
    engine = Engine(
        tiny, LongTokens(), EngineConfig(max_num_seqs=2, max_model_len=128, page_size=16)
    )
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=6, stop=[stop]))
    while engine.has_unfinished():
        outs = engine.step()
    (out,) = outs
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.token_ids == want[:3]
    assert out.text == LongTokens().decode(want[:2])  # cut where the stop string starts


@pytest.mark.parametrize("stop", ["é", "xé", "éy"])
def test_a_stop_string_completed_by_the_last_byte_of_a_character_is_found(stop):
    """Bytes as tokens: a character's first byte decodes to a replacement character that its
    last byte rewrites, so the checker looks back over the previous text's last characters."""

    class Bytes:
        eos_token_ids = ()

        def decode(self, ids):
            return bytes(ids).decode(errors="replace")

    checker = StopChecker(SamplingParams(stop=[stop]), Bytes(), ())
    data = ("a" * 30 + stop + "z").encode()
    ids, reasons = [], []
    for byte in data:
        ids.append(byte)
        reasons.append(checker.check(ids))
    end = len(("a" * 30 + stop).encode())
    assert reasons[end - 1] == stop and not any(reasons[: end - 1])


def _sentencepiece_with_byte_fallback(tmp_path):
    """Llama-2's decoder pipeline over a vocabulary without CJK pieces: "日語" is six byte
    pieces, one run that renders as six U+FFFD until its last byte makes it two characters."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenspeed.runtime.tokenizer import HFTokenizer

    pieces = [("<unk>", 0.0), ("▁", -3.0), ("▁a", -1.0)]
    pieces += [(f"<0x{b:02X}>", -6.0) for b in range(256)]
    tok = tokenizers.Tokenizer(tokenizers.models.Unigram(pieces, 0, byte_fallback=True))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    decoders = tokenizers.decoders
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "sp.json"))
    return HFTokenizer(tmp_path / "sp.json", ())


@pytest.mark.parametrize("stop", ["日語", "語", "a 日語"])
def test_a_stop_string_spelled_by_the_end_of_a_byte_fallback_run_ends_the_output(tmp_path, stop):
    """The run's last byte shortens the text (six U+FFFD become "日語"): the stop string ends
    before where the previous check's text ended, and must still be found at that token, not
    one token late (or never, when the output ends there)."""
    tok = _sentencepiece_with_byte_fallback(tmp_path)
    ids = tok.encode("a 日語 a a")
    assert tok.decode(ids[:8]) == "a 日語" and tok.decode(ids[:7]) == "a " + "\ufffd" * 5
    checker = StopChecker(SamplingParams(stop=[stop]), tok, ())
    reasons = []
    for k in range(1, len(ids) + 1):  # as the engine does: until a check ends the output
        reasons.append(checker.check(ids[:k]))
        checker.text(ids[:k])
        if reasons[-1] is not None:
            break
    assert reasons == [None] * 7 + [stop]
    assert checker.text(ids[:8]) == "a 日語"[: "a 日語".index(stop)]


class _Bytes:
    """Token t is byte t: text is the ids' bytes as UTF-8."""

    eos_token_ids = ()

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def _run(checker, data: bytes) -> tuple[list, int, str]:
    """Feed the bytes as the engine does (check, then text) until a check ends the output."""
    ids, reasons = [], []
    for byte in data:
        ids.append(byte)
        reasons.append(checker.check(ids))
        text = checker.text(ids)
        if reasons[-1] is not None:
            break
    return reasons, len(ids), text


def test_min_tokens_delays_stop_token_ids_and_eos():
    eos, stop = ord("!"), ord("#")
    checker = StopChecker(SamplingParams(min_tokens=3, stop_token_ids=[stop]), _Bytes(), [eos])
    reasons, end, text = _run(checker, b"#!#!ab")
    assert reasons == [None, None, None, eos] and end == 4
    assert text == "#!#"  # the EOS that ended it is left out of the text, the others stay
    reasons, end, text = _run(StopChecker(checker.params, _Bytes(), [eos]), b"#!#ab#")
    assert reasons == [None] * 5 + [stop] and text == "#!#ab"
    # Without min_tokens the first one ends it, as before.
    assert _run(StopChecker(SamplingParams(stop_token_ids=[stop]), _Bytes(), [eos]), b"#!")[:2] == (
        [stop],
        1,
    )


def test_min_tokens_delays_stop_strings_and_keeps_earlier_occurrences_in_the_text():
    """As vLLM: a stop string ends the output only where it ends in the text of a token after
    the first min_tokens (it may start before), and the text is cut there, not at an earlier
    occurrence inside the first tokens' text."""
    checker = StopChecker(SamplingParams(min_tokens=4, stop=["ab"]), _Bytes(), ())
    reasons, end, text = _run(checker, b"ab-xab-ab")
    assert reasons == [None] * 5 + ["ab"] and end == 6
    assert text == "ab-x"
    # One that straddles the boundary: starts in the first tokens, ends after them.
    checker = StopChecker(SamplingParams(min_tokens=3, stop=["xyz"]), _Bytes(), ())
    reasons, end, text = _run(checker, b"-xyz--")
    assert reasons == [None, None, None, "xyz"] and text == "-"
    # Completed by the min_tokens-th token itself: does not count.
    checker = StopChecker(SamplingParams(min_tokens=3, stop=["xyz"]), _Bytes(), ())
    reasons, end, text = _run(checker, b"xyz--")
    assert not any(reasons) and end == 5 and text == "xyz--"
    # The text of the first tokens is never cut while the output runs.
    checker = StopChecker(SamplingParams(min_tokens=3, stop=["a"]), _Bytes(), ())
    assert checker.check([97]) is None and checker.text([97]) == "a"
