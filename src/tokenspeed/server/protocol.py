"""OpenAI request bodies -> what the engine runs: prompts as token ids and `SamplingParams`.

Every check that can be made before the engine sees a request is made here, and fails with an
`ApiError` (400, or 404 for an unknown model) naming the field: the body's shape, the prompt
(empty, ids outside the vocabulary, too long for the context), `max_tokens` (an int >= 1 that
fits the context with the prompt), the sampling parameters (the engine's `SamplingParams` rules),
and fields we do not implement (`logprobs`, `echo`, `tools`, ...), refused rather than ignored.

Fields: the OpenAI ones (model, prompt / messages, max_tokens / max_completion_tokens,
temperature, top_p, n, stop, seed, presence_penalty, frequency_penalty, stream,
stream_options.include_usage) and vLLM's extensions (top_k, min_tokens, repetition_penalty,
ignore_eos, stop_token_ids, add_generation_prompt, chat_template_kwargs, and return_token_ids:
each choice also carries `token_ids`, and `prompt_token_ids`). Unknown fields are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from tokenspeed.runtime.chat_template import ChatTemplateError, encode_rendered, render
from tokenspeed.runtime.sampling_params import SamplingError, SamplingParams

from .errors import ApiError, bad_request
from .served_model import ServedModel

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_N = 128

# Fields we refuse unless they hold their "off" value: ignoring them would answer something else
# than what was asked.
_UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "function_call": (None, "none"),
    "min_p": (None, 0, 0.0),
}
_RESPONSE_FORMATS = (None, {"type": "text"})


@attrs.frozen
class Prompt:
    text: str | None  # None: given as token ids
    token_ids: list[int]


@attrs.frozen
class GenerationRequest:
    """One /v1/completions or /v1/chat/completions call: `prompts` (a chat call has one) times
    `len(params)` completions each (n; completion k of a seeded request has seed + k)."""

    chat: bool
    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.prompts) * len(self.params)


def parse_completion(body: object, model: ServedModel) -> GenerationRequest:
    body = _object(body)
    name = _model(body, model)
    prompts = _completion_prompts(body.get("prompt"), model)
    return _request(body, model, name, prompts, chat=False)


def parse_chat(body: object, model: ServedModel) -> GenerationRequest:
    body = _object(body)
    name = _model(body, model)
    prompt = _chat_prompt(body, model)
    return _request(body, model, name, [prompt], chat=True)


# ------------------------------------------------------------------------------ the body


def _object(body: object) -> Mapping:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, off in _UNSUPPORTED.items():
        if name in body and not any(_same(body[name], value) for value in off):
            raise bad_request(f"'{name}' is not supported by this server", name)
    if not any(_same(body.get("response_format"), v) for v in _RESPONSE_FORMATS):
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    return body


def _same(a: object, b: object) -> bool:
    """Equal, and of the same kind (True is not 1 here)."""
    return type(a) is type(b) and a == b


def _model(body: Mapping, model: ServedModel) -> str:
    name = body.get("model", model.name)
    if name is None:
        name = model.name
    if not isinstance(name, str):
        raise bad_request("'model' must be a string", "model")
    if name != model.name:
        raise ApiError(
            404,
            f"the model '{name}' does not exist; this server serves '{model.name}'",
            param="model",
            code="model_not_found",
        )
    return name


def _flag(body: Mapping, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {value!r}", name)
    return value


# ------------------------------------------------------------------------------ prompts


def _completion_prompts(prompt: object, model: ServedModel) -> list[Prompt]:
    """A string, a list of token ids, or a non-empty list of either (a batch)."""
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        items = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _is_ids(p) for p in prompt)
    ):
        items = prompt
    else:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a non-empty list of those",
            "prompt",
        )
    return [
        _prompt(p, model, f"prompt[{i}]" if len(items) > 1 else "prompt")
        for i, p in enumerate(items)
    ]


def _is_ids(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompt(prompt: str | list[int], model: ServedModel, where: str) -> Prompt:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise bad_request(
                f"{where}: this model has no tokenizer; send the prompt as token ids", "prompt"
            )
        text, ids = prompt, model.tokenizer.encode(prompt)
    else:
        text, ids = None, list(prompt)
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"{where}: token id {bad} is outside the vocabulary [0, {model.vocab_size})",
                "prompt",
            )
    if not ids:
        raise bad_request(f"{where}: the prompt is empty", "prompt")
    _check_context(len(ids), None, model, where)
    return Prompt(text, ids)


def _check_context(
    prompt_len: int,
    max_tokens: int | None,
    model: ServedModel,
    where: str,
    field: str = "max_tokens",
) -> None:
    limit = model.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"{where}: this model's maximum context length is {limit} tokens, and the prompt "
            f"has {prompt_len} (it must leave room for at least one output token)",
            "prompt" if where.startswith("prompt") else "messages",
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise bad_request(
            f"{where}: this model's maximum context length is {limit} tokens; the prompt has "
            f"{prompt_len} and {field} asks for {max_tokens} more ({prompt_len + max_tokens}"
            f"); lower {field} to {limit - prompt_len} or less",
            field,
        )


def _chat_prompt(body: Mapping, model: ServedModel) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", "messages")
    conversation = [_message(m, i) for i, m in enumerate(messages)]
    if model.tokenizer is None:
        raise bad_request("this model has no tokenizer: use /v1/completions with token ids")
    if model.chat_template is None:
        raise bad_request(
            "this model has no chat template (none in its checkpoint); start the server with "
            "--chat-template, or use /v1/completions"
        )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    try:
        text = render(
            model.chat_template,
            conversation,
            add_generation_prompt,
            model.special_tokens,
            **kwargs,
        )
    except (ChatTemplateError, TypeError) as exc:
        raise bad_request(
            f"the chat template failed on these messages: {exc}", "messages"
        ) from None
    ids = encode_rendered(model.tokenizer, text)
    if not ids:
        raise bad_request("the rendered conversation is empty", "messages")
    _check_context(len(ids), None, model, "messages")
    return Prompt(text, ids)


def _message(message: object, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise bad_request(f"{where}: a message is an object with a 'role' string", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(f"{where}: only text content parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: a text part needs a 'text' string", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"{where}: 'content' must be a string or a list of parts", "messages")
    return {**message, "content": content}


# ------------------------------------------------------------------------------ sampling


def _request(
    body: Mapping, model: ServedModel, name: str, prompts: list[Prompt], *, chat: bool
) -> GenerationRequest:
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed with stream: true", "stream_options"
            )
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _flag(options, "include_usage")
    max_tokens = _max_tokens(body, model, prompts, chat)
    n = 1 if body.get("n") is None else _int(body["n"], "n")
    if not 1 <= n <= MAX_N:
        raise bad_request(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    params = _sampling(body, max_tokens)
    seeds = _seeds(params.seed, n)
    per_completion = [params if s == params.seed else params.evolve(seed=s) for s in seeds]
    return GenerationRequest(
        chat=chat,
        model=name,
        prompts=prompts,
        params=per_completion,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=_flag(body, "return_token_ids"),
    )


def _max_tokens(body: Mapping, model: ServedModel, prompts: list[Prompt], chat: bool) -> int:
    """max_tokens (chat: max_completion_tokens first): an int >= 1 that fits the context beside
    every prompt. Default: 16 for completions (OpenAI's), the rest of the context for chat."""
    field = "max_tokens"
    value = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        field, value = "max_completion_tokens", body["max_completion_tokens"]
    if value is None:
        longest = max(len(p.token_ids) for p in prompts)
        if chat:
            return model.max_model_len - longest
        value = min(COMPLETIONS_DEFAULT_MAX_TOKENS, model.max_model_len - longest)
        return value
    value = _int(value, field)
    if value < 1:
        raise bad_request(f"'{field}' must be at least 1, got {value}", field)
    for i, p in enumerate(prompts):
        where = "messages" if chat else (f"prompt[{i}]" if len(prompts) > 1 else "prompt")
        _check_context(len(p.token_ids), value, model, where, field)
    return value


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "seed",
)


def _sampling(body: Mapping, max_tokens: int) -> SamplingParams:
    kwargs: dict = {"max_tokens": max_tokens}
    for name in _SAMPLING_FIELDS:
        if body.get(name) is not None:
            kwargs[name] = body[name]
    if "ignore_eos" in kwargs:
        kwargs["ignore_eos"] = _flag(body, "ignore_eos")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
        kwargs["stop"] = stop
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise bad_request("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        kwargs["stop_token_ids"] = stop_ids
    try:
        return SamplingParams(**kwargs)
    except SamplingError as exc:
        message = str(exc).replace("SamplingParams.", "")
        found = re.match(r"(\w+)", message)
        raise bad_request(message, found.group(1) if found else None) from None


def _seeds(seed: int | None, n: int) -> list[int | None]:
    """Completion k of a seeded request samples with seed + k, wrapped into the seed range
    [-2^63, 2^64) (as `LLM.generate` does), so that the n completions differ."""
    if seed is None:
        return [None] * n
    return [seed + k - (1 << 64) if seed + k >= 1 << 64 else seed + k for k in range(n)]
