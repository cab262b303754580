"""`ServedModel`: what the HTTP layer needs to know about the model behind the engine: its name,
tokenizer, vocabulary, context limit and chat template."""

from __future__ import annotations

from pathlib import Path

import attrs

from tokenspeed.runtime.chat_template import find_chat_template, resolve_template, special_tokens
from tokenspeed.runtime.tokenizer import Tokenizer


@attrs.frozen
class ServedModel:
    """name: the id clients pass as `model`. max_model_len: prompt + output tokens, at most
    (a prompt must leave room for one output token). chat_template: the template's text (None:
    /v1/chat/completions answers 400). special_tokens: bos_token, eos_token, ... for templates
    that use them."""

    name: str
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int
    chat_template: str | None = None
    special_tokens: dict[str, str] = attrs.Factory(dict)
    created: int = 0  # unix time the server started (GET /v1/models)

    @classmethod
    def load(
        cls,
        name: str,
        checkpoint_dir: str | Path | None,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        chat_template: str | Path | None = None,
        created: int = 0,
    ) -> ServedModel:
        """checkpoint_dir: where the model came from (None: a preset); a checkpoint brings its
        chat template and special tokens. chat_template (its text, or a file) wins."""
        root = Path(checkpoint_dir) if checkpoint_dir is not None else None
        if chat_template is not None:
            template = resolve_template(chat_template)
        else:
            template = find_chat_template(root) if root is not None else None
        return cls(
            name=name,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            chat_template=template,
            special_tokens=special_tokens(root),
            created=created,
        )
