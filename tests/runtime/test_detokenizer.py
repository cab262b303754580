"""Incremental detokenization: after every step its text equals a full decode, for each kind of
tokenizer (bytes, tiktoken, Hugging Face ByteLevel, Metaspace and sentencepiece-style pipelines
with byte fallback); stop strings behave as the full-decode checker did; and a step decodes a
short window, not the whole output."""

from __future__ import annotations

import base64
import json
from importlib.util import find_spec

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenspeed.runtime.detokenizer import Detokenizer
from tokenspeed.runtime.sampling_params import SamplingParams
from tokenspeed.runtime.stop import StopChecker
from tokenspeed.runtime.tokenizer import BYTE_STREAM, ByteTokenizer, HFTokenizer, WindowRule

CORPUS = [
    "Agents call tools, wait 12345 ms, then 继续 work.\n",
    "héllo wörld — naïve café; ünïcödé ≠ ascii. 日本語のテキスト 🙂🚀 done\n",
    "def f(x):\n    return x * 2  # 注释\n",
]
TEXT = "".join(CORPUS)
PROP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- the tokenizers under test


def _tiktoken(root):
    from tokenspeed.runtime.tokenizer import TiktokenTokenizer

    ranks = {bytes([b]): b for b in range(256)}
    merges = [b"ag", b"ent", b"ents", b" w", b"ork", b"12", b"123", "继续".encode(), " é".encode()]
    merges += ["继".encode()[:2], "续".encode()[1:], "🙂".encode()[:3], "ö".encode()[1:] + b"r"]
    for merge in merges:
        ranks[merge] = len(ranks)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (root / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    config = {
        "pat_str": r"""[\p{L}\p{N}]+|[^\s\p{L}\p{N}]+|\s+""",
        "added_tokens_decoder": {
            str(base): {"content": "[BOS]"},
            str(base + 1): {"content": "[EOS]"},
        },
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return TiktokenTokenizer(root, ())


def _hf(root, name, build):
    tok = build()
    tok.save(str(root / f"{name}.json"))
    return HFTokenizer(root / f"{name}.json", ())


def _byte_level():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    # An added token passes through the ByteLevel decoder too ("Ġ" is a space, "¸" byte 0xB8).
    tok.add_tokens([AddedToken("ĠtoolÂ¸", special=False)])
    tok.add_special_tokens(["<|im_end|>"])
    return tok


def _unigram(decoder):
    def build():
        from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

        pieces = [("<unk>", 0.0), ("▁", -3.0), ("▁a", -1.0), ("b▁c", -2.0)]
        pieces += [(f"▁{w}", -1.5) for w in ("Agents", "call", "tools,", "wait", "work.", "继续")]
        pieces += [(c, -4.0) for c in sorted(set(TEXT) - {" ", "\n", "🙂", "🚀", "日", "語"})]
        pieces += [(f"<0x{b:02X}>", -6.0) for b in range(256)]
        tok = Tokenizer(models.Unigram(pieces, 0, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoder()
        tok.add_special_tokens(["<s>", "</s>"])
        tok.add_tokens([AddedToken("<tool>", special=False)])
        return tok

    return build


def _metaspace():
    from tokenizers import decoders

    return decoders.Metaspace()


def _llama():  # sentencepiece's legacy pipeline: ▁ to space, bytes, one string, one space off
    from tokenizers import decoders

    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])


def _wordpiece():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "do": 1, "not": 2, "##n": 3, "'": 4, "t": 5, ".": 6, "a": 7, "##b": 8}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()  # no rule claimed for it: decoded whole
    return tok


KINDS = ["bytes", "tiktoken", "byte-level", "metaspace", "llama", "wordpiece"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    made = {"bytes": ByteTokenizer(300, offset=3)}
    if find_spec("tiktoken") is not None:
        made["tiktoken"] = _tiktoken(root)
    if find_spec("tokenizers") is not None:
        made["byte-level"] = _hf(root, "bl", _byte_level)
        made["metaspace"] = _hf(root, "ms", _unigram(_metaspace))
        made["llama"] = _hf(root, "sp", _unigram(_llama))
        made["wordpiece"] = _hf(root, "wp", _wordpiece)
    return made


def _tok(tokenizers, kind):
    if kind not in tokenizers:
        pytest.skip(f"{kind}: its library is not installed")
    return tokenizers[kind]


def _vocab(tok) -> int:
    if isinstance(tok, HFTokenizer):
        return tok._tok.get_vocab_size(with_added_tokens=True)
    if isinstance(tok, ByteTokenizer):
        return 300
    return tok._enc.n_vocab


@st.composite
def outputs(draw, tok):
    """Id sequences a model might emit: pieces of encoded text (multi-byte characters, byte
    fallback runs) mixed with arbitrary ids, special ones and ones past the vocabulary."""
    vocab = _vocab(tok)
    ids: list[int] = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            text = draw(st.sampled_from([*CORPUS, "do not a", "🙂🚀日語 é"]))
            lo = draw(st.integers(0, len(text) - 1))
            ids += tok.encode(text[lo : lo + draw(st.integers(1, 40))])
        else:
            ids += draw(st.lists(st.integers(0, vocab + 4), min_size=1, max_size=12))
    return ids or [draw(st.integers(0, vocab + 4))]  # a piece of text may encode to nothing


# ---------------------------------------------------------------- the text equals a full decode


def test_each_tokenizer_gets_the_rule_its_decoder_allows(tokenizers):
    rules = {kind: getattr(tok, "window_rule", None) for kind, tok in tokenizers.items()}
    assert rules["bytes"] is BYTE_STREAM
    if "tiktoken" in rules:
        assert rules["tiktoken"] is BYTE_STREAM
    if "byte-level" in rules:
        assert rules["byte-level"] is BYTE_STREAM
        assert rules["metaspace"].prefix and rules["metaspace"].closes is None
        closes = rules["llama"].closes
        tok = tokenizers["llama"]._tok
        assert rules["llama"].prefix and closes is not None
        assert not closes(tok.token_to_id("<0xE4>")) and closes(tok.token_to_id("▁a"))
        assert not closes(tok.token_to_id("</s>")) and not closes(10**6)  # render nothing
        assert rules["wordpiece"] is None


@pytest.mark.parametrize("kind", KINDS)
def test_the_text_after_every_step_is_the_full_decode(tokenizers, kind):
    tok = _tok(tokenizers, kind)

    @PROP
    @given(data=st.data())
    def run(data):
        ids = data.draw(outputs(tok))
        detok = Detokenizer(tok)
        k = 0
        while k < len(ids):  # one token a step, or several (multi-step decoding)
            k = min(len(ids), k + data.draw(st.sampled_from([1, 1, 1, 2, 5])))
            detok.update(ids, k)
            assert detok.text == tok.decode(ids[:k]), (ids, k)
            assert len(detok) == len(detok.text)
            at = data.draw(st.integers(0, len(detok) + 2))
            assert detok.text_from(at) == detok.text[at:]
        assert detok.incremental == (kind != "wordpiece")

    run()


@pytest.mark.parametrize("kind", ["bytes", "tiktoken", "byte-level", "metaspace", "llama"])
def test_a_step_decodes_a_short_window_not_the_whole_output(tokenizers, kind):
    tok = Counting(_tok(tokenizers, kind))
    ids = tok.encode(TEXT * 8)
    checker = StopChecker(SamplingParams(stop=["never there"]), tok, ())
    for k in range(1, len(ids) + 1):
        assert checker.check(ids[:k]) is None
        checker.text(ids[:k])
    assert checker.text(ids) == tok.decode(ids)
    # Decoding the whole output at each step reads ~n^2/2 ids (twice that with stop strings).
    assert tok.decoded < 10 * len(ids), (tok.decoded, len(ids))
    assert len(checker._detok.tail) <= 8


def test_the_first_token_handling_of_sentencepiece_falls_on_the_dropped_context(tokenizers):
    """A window decoded alone loses its first token's leading space ("▁a" -> "a"); behind its
    context it keeps it, as in the full decode."""
    tok = _tok(tokenizers, "metaspace")
    a = tok._tok.token_to_id("▁a")
    detok = Detokenizer(tok)
    for k in range(1, 6):
        detok.update([a] * 5, k)
        assert detok.text == "a" + " a" * (k - 1) == tok.decode([a] * k)
    assert tok.decode([a]) == "a" and detok._prefix > 0  # windows start past the first token


@pytest.mark.parametrize("kind", ["metaspace", "llama"])
def test_ids_that_render_nothing_are_no_context(tokenizers, kind):
    """A special token (skipped) or an unknown id in front of "▁a" would leave "▁a" first in
    the window, and its space dropped: such ids never make the whole context."""
    tok = _tok(tokenizers, kind)
    a, end = tok._tok.token_to_id("▁a"), tok._tok.token_to_id("</s>")
    for nothing in (end, 10**6):
        ids = [a, nothing, a, nothing, nothing, a]
        detok = Detokenizer(tok)
        for k in range(1, len(ids) + 1):
            detok.update(ids, k)
            assert detok.text == tok.decode(ids[:k])
        assert detok.text == "a a a"


def test_a_byte_fallback_run_stays_unsettled_until_a_piece_closes_it(tokenizers):
    """The character "中" is three byte pieces; a fourth byte makes the run invalid, and then
    all four render as U+FFFD (a run decodes as one): text settled at "中" would be wrong."""
    tok = _tok(tokenizers, "llama")
    byte = {b: tok._tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    a = tok._tok.token_to_id("▁a")
    ids = [a, *(byte[b] for b in "中".encode()), byte[0x80], a]
    detok = Detokenizer(tok)
    for k in range(1, len(ids) + 1):
        detok.update(ids, k)
        assert detok.text == tok.decode(ids[:k])
    assert tok.decode(ids[:4]) == "a中" and detok.text == "a\ufffd\ufffd\ufffd\ufffd a"


def test_incomplete_utf8_is_held_back_until_it_settles():
    tok = ByteTokenizer(300, offset=3)
    ids = tok.encode("ab🙂c")
    detok = Detokenizer(tok)
    for k in range(1, len(ids) + 1):
        detok.update(ids, k)
        if 3 <= k < 6:  # inside the emoji's four bytes
            assert detok.settled == "ab" and detok.tail == "\ufffd"
    assert detok.settled == "ab🙂c" and detok.tail == ""


def test_a_tokenizer_that_breaks_its_rule_is_decoded_whole_from_then_on():
    class Numbered:
        """Claims the prefix rule, but its text names how many ids it was given."""

        window_rule = WindowRule(prefix=True)

        def decode(self, ids):
            return f"{len(ids)}:" + "".join(chr(97 + i % 26) for i in ids)

    tok = Numbered()
    detok = Detokenizer(tok)
    for k in range(1, 8):
        detok.update(list(range(7)), k)
        assert detok.text == tok.decode(range(k))
    assert not detok.incremental


def test_a_tokenizer_error_leaves_the_text_as_it_was():
    class Flaky(ByteTokenizer):
        fail = False

        def decode(self, ids):
            if self.fail:
                raise KeyError("flaky")
            return super().decode(ids)

    tok = Flaky(300)
    ids = tok.encode("héllo wörld")
    detok = Detokenizer(tok)
    for k in range(1, len(ids) + 1):
        tok.fail = k % 3 == 0
        if tok.fail:
            before = (detok.settled, detok.tail, detok.num_ids)
            with pytest.raises(KeyError):
                detok.update(ids, k)
            assert (detok.settled, detok.tail, detok.num_ids) == before
            tok.fail = False
        detok.update(ids, k)
        assert detok.text == tok.decode(ids[:k])
    with pytest.raises(ValueError, match="only grows"):
        detok.update(ids, 2)


# ---------------------------------------------------------------- stop strings as before


class FullDecodeStopChecker:
    """The stop checker before incremental detokenization (its logic, but each check searches
    the whole text, not only its last few characters, which a byte-fallback run can rewrite):
    the reference. An output ends at the first token after which its full decode holds a stop
    string."""

    def __init__(self, params, tokenizer, eos_token_ids):
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)

    def check(self, output_ids):
        last = output_ids[-1]
        if last in self.stop_ids:
            return last
        if self.params.stop:
            text = self.tokenizer.decode(output_ids)
            for stop in self.params.stop:
                if stop in text:
                    return stop
        return None

    def text(self, output_ids):
        ids = list(output_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        for stop in self.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return text


@pytest.mark.parametrize("kind", KINDS)
def test_stop_strings_and_ids_end_and_cut_the_output_as_before(tokenizers, kind):
    tok = _tok(tokenizers, kind)

    @PROP
    @given(data=st.data())
    def run(data):
        ids = data.draw(outputs(tok))
        whole = tok.decode(ids)
        stops = []
        for _ in range(data.draw(st.integers(0, 3))):
            if whole and data.draw(st.booleans()):  # a piece of the text: likely to stop it
                at = data.draw(st.integers(0, len(whole) - 1))
                stops.append(whole[at : at + data.draw(st.integers(1, 4))])
            else:
                stops.append(data.draw(st.text("ab é\ufffd继🙂", min_size=1, max_size=3)))
        stop_ids = data.draw(st.lists(st.sampled_from(ids), max_size=2))
        params = SamplingParams(stop=stops, stop_token_ids=stop_ids, ignore_eos=True)
        old, new = FullDecodeStopChecker(params, tok, ()), StopChecker(params, tok, ())
        for k in range(1, len(ids) + 1):
            reason = old.check(ids[:k])
            assert new.check(ids[:k]) == reason, (ids, k, stops)
            if reason is not None or data.draw(st.booleans()):  # not every step reports
                assert new.text(ids[:k]) == old.text(ids[:k]), (ids, k, stops)
            if reason is not None:
                break

    run()


def test_the_settled_text_is_searched_once_for_stop_strings():
    """A stop string found in the settled text stays found, also when another one is found
    later in the tail; the cut is where the full-decode checker cuts."""
    tok = ByteTokenizer(300, offset=3)
    ids = tok.encode("xx abcd yy bc")
    params = SamplingParams(stop=["cd", "bc", "zz"])
    old, new = FullDecodeStopChecker(params, tok, ()), StopChecker(params, tok, ())
    for k in range(1, len(ids) + 1):
        assert new.text(ids[:k]) == old.text(ids[:k])
    assert new.text(ids) == "xx ab"  # "cd" cuts first; "bc" then no longer fits in "xx ab"
    assert new._in_settled == {"cd": 5, "bc": 4, "zz": None}


class Counting:
    """A tokenizer that counts the ids it decodes (and keeps the inner one's rule)."""

    eos_token_ids = ()

    def __init__(self, inner):
        self.inner = inner
        self.window_rule = getattr(inner, "window_rule", None)
        self.decoded = 0

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, ids):
        self.decoded += len(ids)
        return self.inner.decode(ids)
