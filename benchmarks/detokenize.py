"""Output text per engine step: the full re-decode of before against incremental detokenization.

Claim: with `Detokenizer` (src/tokenspeed/runtime/detokenizer.py) a step's text costs a short
window's decode, flat in the output's length, where the full re-decode grew with it (O(n) per
step, O(n^2) over an output). Both run side by side in one process on the same ids: the project's
docs (README.md, docs/**/*.md) tokenized by each kind of tokenizer, cut to outputs of 1k, 4k and
16k tokens. A step is what the engine does per request per step: `check` (which decodes only
when stop strings are set; two that never occur here, so every output runs to its end), then
`text`. "old" is the StopChecker before this change, verbatim; "new" is `StopChecker` now.

Tokenizers: `ByteTokenizer` (the presets'); a BPE of 4096 tokens trained on the same docs, as a
Hugging Face ByteLevel tokenizer (GPT-2 / Llama 3 / DeepSeek style), as a Kimi-style tiktoken
tokenizer (`TiktokenTokenizer`, the same ranks) and as a sentencepiece-style one (Metaspace
pre-tokenizer; Replace, ByteFallback, Fuse, Strip decoder: the prefix-window path, two window
decodes per step).

Times are CPU time of the benchmark's thread (`time.thread_time`), so that other processes on a
shared machine count less. Per step at the end: the median of the output's last 64 steps, each
timed alone. Total: the sum over every step of the output; for the old path at 16k tokens it is
estimated from every 16th step (times 16), as running each of its steps takes minutes. Every
run checks that both give the same final text. A step is timed on the engine's own list of
output ids (grown by one id, passed as it is): a copy of 16k ids per step alone costs ~40 us.

    python benchmarks/detokenize.py [--lengths 1024,4096,16384]
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenspeed.runtime.sampling_params import SamplingParams
from tokenspeed.runtime.stop import _UNSETTLED_CHARS, StopChecker
from tokenspeed.runtime.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer

ROOT = Path(__file__).resolve().parent.parent
STOPS = ["<|never|>", "\n\n\n\n\nnever"]
TAIL_STEPS = 64
OLD_STRIDE = 16  # the old path's 16k total: every 16th step, times 16
clock = time.thread_time
KIMI_PAT = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{L}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


class OldStopChecker:
    """StopChecker before incremental detokenization: a full decode per check and per text."""

    def __init__(self, params, tokenizer, eos_token_ids):
        self.params = params
        self.tokenizer = tokenizer
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._checked_len = 0

    def check(self, output_ids):
        last = output_ids[-1]
        if last in self.stop_ids:
            return last
        if self.params.stop:
            text = self.tokenizer.decode(output_ids)
            start = max(0, self._checked_len - _UNSETTLED_CHARS - self._longest_stop + 1)
            self._checked_len = len(text)
            tail = text[start:]
            for stop in self.params.stop:
                if stop in tail:
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


def corpus() -> str:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return "\n".join(f.read_text() for f in files)


def tokenizers(text: str, root: Path) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    made = {"bytes (presets)": ByteTokenizer(512)}
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=4096, initial_alphabet=alphabet, show_progress=False)
    )
    bpe.save(str(root / "byte_level.json"))
    made["HF ByteLevel BPE"] = HFTokenizer(root / "byte_level.json", ())

    # The same vocabulary as tiktoken ranks (ids follow merge order, as ranks must).
    to_byte = {c: b for b, c in enumerate(_byte_alphabet())}
    ranks = {bytes(to_byte[c] for c in token): i for token, i in bpe.get_vocab().items()}
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=_rank)]
    kimi = root / "kimi"
    kimi.mkdir()
    (kimi / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (kimi / "tokenizer_config.json").write_text(json.dumps({"pat_str": KIMI_PAT}))
    made["Kimi tiktoken"] = TiktokenTokenizer(kimi, ())

    sp = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    sp.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    sp.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>"], show_progress=False)
    )
    sp.save(str(root / "sentencepiece.json"))
    made["HF sentencepiece-style"] = HFTokenizer(root / "sentencepiece.json", ())
    return made


def _rank(item):
    return item[1]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet, indexed by byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def step(checker, out) -> None:
    checker.check(out)
    checker.text(out)


def run_all(checker, ids) -> tuple[float, float]:
    """Every step of the output, the engine's way (its output list grows by one id a step and
    is passed as it is): (total s, median s of the last TAIL_STEPS steps, each timed alone)."""
    out: list[int] = []
    head = len(ids) - TAIL_STEPS
    start = clock()
    for token in ids[:head]:
        out.append(token)
        step(checker, out)
    total = clock() - start
    times = []
    for token in ids[head:]:
        start = clock()
        out.append(token)
        step(checker, out)
        times.append(clock() - start)
    return total + sum(times), statistics.median(times)


def run_old(params, tok, ids, stride: int) -> tuple[float, float, str]:
    """The old path; with stride > 1 the total is estimated from every stride-th step and the
    last steps are timed on a fresh checker (the old one keeps only a text length)."""
    checker = OldStopChecker(params, tok, ())
    if stride == 1:
        total, per_step = run_all(checker, ids)
        return total, per_step, checker.text(ids)
    total = 0.0
    for k in range(stride, len(ids) + 1, stride):
        out = ids[:k]
        start = clock()
        step(checker, out)
        total += clock() - start
    checker = OldStopChecker(params, tok, ())
    times = []
    for k in range(len(ids) - TAIL_STEPS + 1, len(ids) + 1):
        out = ids[:k]
        start = clock()
        step(checker, out)
        times.append(clock() - start)
    return total * stride, statistics.median(times), checker.text(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    text = corpus()
    print(
        f"detokenization per engine step, old (full re-decode) vs new (incremental), "
        f"{datetime.date.today()}, Python {sys.version.split()[0]}"
    )
    print(f"corpus: README.md + docs/**/*.md, {len(text)} characters; stop strings {STOPS!r}")
    print()
    print(
        "| tokenizer | tokens | stop strings | old us/step at end | new us/step at end | ratio "
        "| old total ms | new total ms | ratio |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, tok in tokenizers(text, Path(tmp)).items():
            all_ids = tok.encode(text)
            while len(all_ids) < max(lengths):
                all_ids += all_ids
            for n in lengths:
                ids = all_ids[:n]
                for stops in ((), tuple(STOPS)):
                    params = SamplingParams(stop=stops, ignore_eos=True)
                    new = StopChecker(params, tok, ())
                    new_total, new_step = run_all(new, ids)
                    stride = OLD_STRIDE if n > 4096 else 1
                    old_total, old_step, old_text = run_old(params, tok, ids, stride)
                    if new.text(ids) != old_text:
                        raise SystemExit(f"{name}, {n} tokens: the texts differ")
                    mark = "~" if stride > 1 else ""
                    print(
                        f"| {name} | {n} | {'yes' if stops else 'no'} | {old_step * 1e6:.1f} "
                        f"| {new_step * 1e6:.1f} | {old_step / new_step:.0f}x "
                        f"| {mark}{old_total * 1e3:.0f} | {new_total * 1e3:.1f} "
                        f"| {mark}{old_total / new_total:.0f}x |",
                        flush=True,
                    )
    print()
    print(f"~: the old path's total estimated from every {OLD_STRIDE}th step; same final text: yes")


if __name__ == "__main__":
    main()
