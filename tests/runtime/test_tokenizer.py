"""Tokenizers from checkpoint files: tokenizer.json and Kimi-style tiktoken files."""

import base64
import json

import pytest

from tokenspeed.runtime.tokenizer import (
    RESERVED_SPECIAL_TOKENS,
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    load_tokenizer,
    read_pat_str,
)

TEXT = "Agents call tools, wait 12345 ms, then 继续 work.\n"

MODULE = '''
import tiktoken

class TikTokenTokenizer:
    special_tokens = {}
    pat_str = "|".join(
        [
            r"""[\\p{Han}]+""",
            r"""[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re)?""",
            r"""\\p{N}{1,3}""",
            r""" ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*""",
            r"""\\s+(?!\\S)""",
            r"""\\s+""",
        ]
    )
'''


def _tiktoken_dir(tmp_path, module=MODULE):
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"ag", b"ent", b"ents", b" w", b"ork", b"12", b"123"):
        ranks[merge] = len(ranks)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    config = {
        "added_tokens_decoder": {
            str(base): {"content": "[BOS]"},
            str(base + 1): {"content": "[EOS]"},
        }
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if module is not None:
        (tmp_path / "tokenization_kimi.py").write_text(module)
    return tmp_path, base


def test_pat_str_is_read_without_executing_the_module():
    pattern = read_pat_str(MODULE)
    assert pattern.startswith("[\\p{Han}]+|") and pattern.endswith("|\\s+")
    assert read_pat_str("import os\nos.system('false')\n") is None
    assert read_pat_str('pat_str = r"\\w+"') == "\\w+"


def test_kimi_tiktoken_files_round_trip(tmp_path):
    root, base = _tiktoken_dir(tmp_path)
    tok = load_tokenizer(root, eos_token_ids=[base + 1])
    assert isinstance(tok, TiktokenTokenizer)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode())  # merges were applied
    assert tok.decode([*ids, base + 1]) == TEXT  # special tokens are not rendered
    assert tok.eos_token_ids == (base + 1,)


def test_tiktoken_renders_ids_past_its_encoding_as_nothing(tmp_path):
    """A model's vocabulary is often padded past its tokenizer's: an id there (which a model
    with random or odd weights can sample) decodes to nothing rather than raising, like the
    other tokenizers (`tiktoken` itself raises KeyError)."""
    root, base = _tiktoken_dir(tmp_path)
    tok = load_tokenizer(root)
    ids = tok.encode(TEXT)
    past = base + RESERVED_SPECIAL_TOKENS + 5
    assert tok.decode([past, *ids, past + 1]) == TEXT


def test_tiktoken_without_a_pattern_is_refused(tmp_path):
    root, _ = _tiktoken_dir(tmp_path, module=None)
    with pytest.raises(TokenizerError, match="needs a split pattern"):
        load_tokenizer(root)


def test_tokenizer_json_round_trip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT * 20], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, HFTokenizer)
    assert loaded.decode(loaded.encode(TEXT)) == TEXT


def test_no_tokenizer_files(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_byte_tokenizer():
    tok = ByteTokenizer(512)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    with pytest.raises(TokenizerError):
        ByteTokenizer(100)


@pytest.mark.parametrize(
    "content", [b'{"version": "1.0", "model": ', b"\xff\xfe not json", b'{"model": 3}']
)
def test_a_corrupt_tokenizer_json_is_a_tokenizer_error_naming_the_file(tmp_path, content):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)
    assert "cannot be read as a tokenizer" in str(info.value)


@pytest.mark.parametrize(
    ("file", "content"),
    [
        ("tiktoken.model", "not-base64!! 0\n"),
        ("tiktoken.model", "YQ== zero\n"),
        ("tiktoken.model", "YQ==\n"),
        ("tokenizer_config.json", "{not json"),
        ("tokenizer_config.json", '{"added_tokens_decoder": {"x": {"content": "[BOS]"}}}'),
    ],
)
def test_corrupt_tiktoken_files_are_tokenizer_errors_naming_the_file(tmp_path, file, content):
    root, _ = _tiktoken_dir(tmp_path)
    (root / file).write_text(content)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(root)
    assert str(root / file) in str(info.value)


def test_a_tokenizer_module_that_is_not_python_is_named(tmp_path):
    root, _ = _tiktoken_dir(tmp_path, module="pat_str = (\n")
    with pytest.raises(TokenizerError, match="tokenization_kimi.py cannot be read"):
        load_tokenizer(root)
