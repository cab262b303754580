"""Tokenizers: a checkpoint's own (Hugging Face `tokenizer.json` or Kimi's tiktoken files), or a
byte-level stand-in for presets, which ship none.

Kimi K3 ships `tiktoken.model` (base64 token + rank per line), special tokens in
`tokenizer_config.json` and its split pattern only inside its `tokenization_*.py`; the pattern is
read from that file's `pat_str` assignment (parsed, never executed).
"""

from __future__ import annotations

import ast
import base64
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

# Kimi's tiktoken tokenizer reserves this many ids after the base vocabulary for special tokens.
RESERVED_SPECIAL_TOKENS = 256


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded from the files given."""


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past `offset` special ids (presets with random weights)."""

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

        self._tok = _Tokenizer.from_file(str(path))
        self.eos_token_ids = tuple(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


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

    def __init__(self, root: Path, eos_token_ids: Sequence[int]):
        import tiktoken

        ranks = {}
        for line in (root / "tiktoken.model").read_bytes().splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        config = {}
        if (root / "tokenizer_config.json").is_file():
            config = json.loads((root / "tokenizer_config.json").read_text())
        pattern = config.get("pat_str")
        for module in sorted(root.glob("tokenization_*.py")):
            pattern = pattern or read_pat_str(module.read_text())
        if not pattern:
            raise TokenizerError(
                f"{root}: tiktoken.model needs a split pattern: a pat_str in tokenizer_config.json "
                "or in a tokenization_*.py next to it"
            )
        named = {
            entry["content"]: int(i) for i, entry in config.get("added_tokens_decoder", {}).items()
        }
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

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens and ids the encoding does not have (a model's vocabulary is often
        padded past its tokenizer's) render as nothing, as with the other tokenizers."""
        return self._enc.decode([i for i in ids if i in self._ordinary_ids])


def load_tokenizer(path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer | None:
    """The tokenizer stored in a checkpoint directory, or None when it has none."""
    root = Path(path)
    if (root / "tokenizer.json").is_file():
        return HFTokenizer(root / "tokenizer.json", eos_token_ids)
    if (root / "tiktoken.model").is_file():
        return TiktokenTokenizer(root, eos_token_ids)
    return None
