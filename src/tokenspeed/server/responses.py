"""The OpenAI response objects: completions and chat completions, whole or as stream chunks,
and their `usage`."""

from __future__ import annotations

from tokenspeed.runtime.outputs import RequestOutput


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(finals: dict[int, RequestOutput], n: int) -> dict:
    """Usage of a call from the final output of each choice (choice i: prompt i // n). Each
    prompt counts once, with the most prompt tokens any of its n completions found cached."""
    prompts: dict[int, tuple[int, int]] = {}
    completion = 0
    for index, out in finals.items():
        completion += len(out.token_ids)
        cached = prompts.get(index // n, (0, 0))[1]
        prompts[index // n] = (len(out.prompt_token_ids), max(cached, out.metrics.cached_tokens))
    return usage(
        sum(t for t, _ in prompts.values()), completion, sum(c for _, c in prompts.values())
    )


def _head(rid: str, obj: str, created: int, model: str) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model}


def completion(
    rid: str,
    created: int,
    model: str,
    finals: dict[int, RequestOutput],
    n: int,
    chat: bool,
    return_token_ids: bool,
) -> dict:
    choices = []
    for index in sorted(finals):
        out = finals[index]
        seq = out.outputs[0]
        choice: dict = {"index": index}
        if chat:
            choice["message"] = {"role": "assistant", "content": seq.text}
        else:
            choice["text"] = seq.text
        choice["logprobs"] = None
        choice["finish_reason"] = seq.finish_reason
        choice["stop_reason"] = seq.stop_reason
        if return_token_ids:
            choice["token_ids"] = list(seq.token_ids)
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
        choices.append(choice)
    body = _head(rid, "chat.completion" if chat else "text_completion", created, model)
    body["choices"] = choices
    body["usage"] = usage_of(finals, n)
    return body


class ChunkMaker:
    """The chunks of one streamed call: `choice(...)` for a choice's new text, `usage(...)` for
    the last one (stream_options.include_usage: every other chunk then has "usage": null)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool):
        self.chat = chat
        self.include_usage = include_usage
        self._head = _head(
            rid, "chat.completion.chunk" if chat else "text_completion", created, model
        )

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None = None,
        token_ids: list[int] | None = None,
        prompt_token_ids: list[int] | None = None,
        role: bool = False,
    ) -> dict:
        choice: dict = {"index": index}
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        if token_ids is not None:
            choice["token_ids"] = token_ids
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
        chunk = {**self._head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage(self, value: dict) -> dict:
        return {**self._head, "choices": [], "usage": value}
