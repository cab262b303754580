"""Chat templates: conversations rendered to prompt text the way Hugging Face's
`apply_chat_template` does (a sandboxed Jinja2 environment with the same filters and globals).

A checkpoint's template is `chat_template.jinja` beside its tokenizer files or the
`chat_template` entry of its `tokenizer_config.json` (a string, or a list of named templates of
which "default" is used); the file wins, as in transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from .tokenizer import TiktokenTokenizer, Tokenizer

# Special tokens of tokenizer_config.json a template may refer to (`{{ bos_token }}`).
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A chat template that cannot be read, compiled or rendered."""


def _read_config(root: Path) -> dict:
    path = root / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"{path}: unreadable ({exc})") from exc
    return config if isinstance(config, dict) else {}


def find_chat_template(root: str | Path) -> str | None:
    """The chat template a checkpoint directory ships, or None."""
    root = Path(root)
    file = root / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = _read_config(root).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    legacy = root / "chat_template.json"  # processors' file: {"chat_template": "..."}
    if legacy.is_file():
        try:
            template = json.loads(legacy.read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            template = None
        if isinstance(template, str) and template:
            return template
    return None


def special_tokens(root: str | Path | None) -> dict[str, str]:
    """bos_token, eos_token, ... of a checkpoint's tokenizer_config.json (strings or
    AddedToken dicts), for templates that use them."""
    if root is None:
        return {}
    config = _read_config(Path(root))
    tokens = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def resolve_template(template: str | Path) -> str:
    """A `chat_template=` argument: the template's text, or (a Path, or a string without Jinja
    markup naming a file) the file holding it."""
    if isinstance(template, Path):
        return template.read_text()
    if not isinstance(template, str):
        raise ChatTemplateError(f"chat_template must be a str or a Path, got {template!r}")
    if "{" not in template and "\n" not in template and Path(template).is_file():
        return Path(template).read_text()
    return template


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers):
        renders its body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def render(
    template: str,
    messages: Sequence[Mapping],
    add_generation_prompt: bool = True,
    tokens: Mapping[str, str] | None = None,
    **kwargs,
) -> str:
    """The conversation's prompt text, as `apply_chat_template(..., tokenize=False)` gives it."""
    import jinja2

    compiled = _compile(template)
    try:
        return compiled.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            **{**(tokens or {}), **kwargs},
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from exc


def encode_rendered(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat prompt. Its special tokens (`<|im_start|>`, ...) must become
    their ids, as the checkpoint's own tokenizer does: a `tokenizers` tokenizer and the byte
    tokenizer do so in `encode`; Kimi's tiktoken encoding is asked to allow them (by default its
    `encode` reads them as plain text)."""
    if isinstance(tokenizer, TiktokenTokenizer):
        return tokenizer.encode(text, allow_special=True)
    return tokenizer.encode(text)
