"""Tokenizers: a checkpoint's own (Hugging Face `tokenizer.json` or Kimi's tiktoken files), or a
byte-level stand-in for presets, which ship none.

Kimi K3 ships `tiktoken.model` (base64 token + rank per line), special tokens in
`tokenizer_config.json` and its split pattern only inside its `tokenization_*.py`; the pattern is
read from that file's `pat_str` assignment (parsed, never executed).
"""

from __future__ import annotations

import ast
import base64
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import attrs

# Kimi's tiktoken tokenizer reserves this many ids after the base vocabulary for special tokens.
RESERVED_SPECIAL_TOKENS = 256


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded from the files given."""


class Tokenizer(Protocol):
    """A tokenizer may also have a `window_rule` (a `WindowRule`) telling how its decode of a
    window of ids relates to its decode of the whole; without one, output text is decoded whole
    at every step."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@attrs.frozen(kw_only=True)
class WindowRule:
    """What lets `Detokenizer` decode only a request's newest ids, a short window at a time, and
    still give exactly the text that decoding all its ids gives.

    prefix: False when the text is a function of the ids' bytes laid end to end, decoded as
    UTF-8 with U+FFFD for bad or incomplete sequences: then decode(a + b) == decode(a) +
    decode(b) whenever decode(a) ends in a character other than U+FFFD, and a window needs no
    context. True when a decode treats its first ids differently (sentencepiece's Metaspace
    drops the first token's leading space, a Strip after Fuse its first character): the new ids
    are then decoded behind a few earlier ids whose text is known and dropped.
    closes: whether the text may be taken as final after this id; False for an id that a later
    one can still change (a byte-fallback piece <0x..> joins the pieces after it). None: any id.
    """

    prefix: bool = False
    closes: Callable[[int], bool] | None = None


BYTE_STREAM = WindowRule()  # text = UTF-8 of the ids' bytes laid end to end


class ByteTokenizer:
    """UTF-8 bytes shifted past `offset` special ids (presets with random weights)."""

    window_rule = BYTE_STREAM

    def __init__(self, vocab_size: int, offset: int = 3, eos_token_ids: Sequence[int] = ()):
        if vocab_size < 256 + offset:
            raise TokenizerError(f"a vocabulary of {vocab_size} cannot hold byte tokens")
        self.offset = offset
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset)
        return data.decode(errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer from `tokenizer.json`."""

    def __init__(self, path: Path, eos_token_ids: Sequence[int]):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a corrupt file
            raise TokenizerError(_unreadable(path, exc)) from exc
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @functools.cached_property
    def window_rule(self) -> WindowRule | None:
        """From the decoder pipeline: ByteLevel alone decodes a byte stream; Metaspace, Replace,
        ByteFallback and Strip token by token, then at most Fuse and a Strip of leading
        characters (sentencepiece's pipelines), decode behind a prefix. Anything else (WordPiece,
        whose cleanup worked on the joined text in older releases; CTC, which merges repeated
        tokens; BPE suffixes; no decoder at all) is decoded whole."""
        decoder = self._tok.decoder
        if decoder is None:
            return None
        steps = _decoder_steps(json.loads(decoder.__getstate__()))
        kinds = [step.get("type") for step in steps]
        if kinds == ["ByteLevel"]:
            return BYTE_STREAM
        fused = False
        for step in steps:
            kind = step.get("type")
            if kind == "Fuse" and not fused:
                fused = True
            elif kind == "Strip" and (not fused or step.get("stop") == 0):
                pass  # per token before Fuse; after it, only the text's start changes
            elif kind not in ("Metaspace", "Replace", "ByteFallback") or fused:
                return None
        if "ByteFallback" not in kinds:
            return WindowRule(prefix=True)
        special = {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}

        def closes(i: int) -> bool:
            # The text may settle after a token that is rendered and is not a byte piece: a run
            # of <0x..> pieces decodes as one (all U+FFFD if it is not valid UTF-8 as a whole),
            # and ids that render nothing (skipped special tokens, unknown ids) do not end a run.
            piece = None if i in special else self._tok.id_to_token(i)
            return piece is not None and not (
                len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
            )

        return WindowRule(prefix=True, closes=closes)


def _decoder_steps(config: dict) -> list[dict]:
    """A `tokenizers` decoder's JSON as the flat list of its steps (Sequences unnested)."""
    if config.get("type") == "Sequence":
        return [step for inner in config.get("decoders", []) for step in _decoder_steps(inner)]
    return [config]


def read_pat_str(source: str) -> str | None:
    """The split pattern assigned to `pat_str` in a tokenizer module's source, if it is a string
    literal or `"sep".join([...literals...])`."""
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assign):
            continue
        if not any(isinstance(t, ast.Name) and t.id == "pat_str" for t in node.targets):
            continue
        value = node.value
        try:
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr == "join"
                and len(value.args) == 1
            ):
                sep = ast.literal_eval(value.func.value)
                return sep.join(ast.literal_eval(value.args[0]))
            return ast.literal_eval(value)
        except (ValueError, TypeError):
            return None
    return None


class TiktokenTokenizer:
    """Kimi's tiktoken tokenizer: `tiktoken.model` ranks, special tokens from
    `tokenizer_config.json`, the split pattern from the checkpoint's tokenizer module (or a
    `pat_str` entry in tokenizer_config.json)."""

    window_rule = BYTE_STREAM  # tiktoken decodes the tokens' bytes laid end to end

    def __init__(self, root: Path, eos_token_ids: Sequence[int]):
        import tiktoken

        ranks = {}
        model = root / "tiktoken.model"
        for number, line in enumerate(model.read_bytes().splitlines(), 1):
            if line.strip():
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except ValueError as exc:  # binascii.Error is a ValueError
                    raise TokenizerError(
                        _unreadable(model, f"line {number} is not 'base64-token rank': {exc}")
                    ) from exc
        config = {}
        config_path = root / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_bytes())
            except ValueError as exc:
                raise TokenizerError(_unreadable(config_path, exc)) from exc
            if not isinstance(config, dict):
                raise TokenizerError(_unreadable(config_path, "not a JSON object"))
        pattern = config.get("pat_str")
        for module in sorted(root.glob("tokenization_*.py")):
            try:
                pattern = pattern or read_pat_str(module.read_text())
            except (SyntaxError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
                raise TokenizerError(_unreadable(module, f"not Python source ({exc})")) from exc
        if not pattern:
            raise TokenizerError(
                f"{root}: tiktoken.model needs a split pattern: a pat_str in tokenizer_config.json "
                "or in a tokenization_*.py next to it"
            )
        try:
            named = {
                entry["content"]: int(i)
                for i, entry in config.get("added_tokens_decoder", {}).items()
            }
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise TokenizerError(
                _unreadable(
                    config_path,
                    f"added_tokens_decoder must map ids to {{'content': ...}} ({exc!r})",
                )
            ) from exc
        taken = set(named.values())
        base = len(ranks)
        special = dict(named)
        for i in range(base, base + RESERVED_SPECIAL_TOKENS):
            if i not in taken:
                special[f"<|reserved_token_{i}|>"] = i
        self._enc = tiktoken.Encoding(
            name=root.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
        )
        self._special_ids = set(special.values())
        self._ordinary_ids = frozenset(ranks.values())
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in it (`<|im_start|>`, ...) are plain text
        unless `allow_special` (a rendered chat template's are meant as the tokens)."""
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode(text, disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens and ids the encoding does not have (a model's vocabulary is often
        padded past its tokenizer's) render as nothing, as with the other tokenizers."""
        return self._enc.decode([i for i in ids if i in self._ordinary_ids])


def _unreadable(path: Path, cause) -> str:
    return f"{path} cannot be read as a tokenizer: {cause}"


def load_tokenizer(path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer | None:
    """The tokenizer stored in a checkpoint directory, or None when it has none."""
    root = Path(path)
    if (root / "tokenizer.json").is_file():
        return HFTokenizer(root / "tokenizer.json", eos_token_ids)
    if (root / "tiktoken.model").is_file():
        return TiktokenTokenizer(root, eos_token_ids)
    return None
