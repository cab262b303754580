"""What the engine hands back: per-request outputs and timing, in vLLM's shape."""

from __future__ import annotations

import attrs


@attrs.define(eq=False)
class CompletionOutput:
    """One generated sequence. finish_reason: None while running, then "stop" (EOS, a stop
    token or a stop string), "length" (max_tokens or the model's limit) or "abort"."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@attrs.define(eq=False)
class RequestMetrics:
    """Seconds on the engine's monotonic clock."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@attrs.define(eq=False)
class RequestOutput:
    """The state of one request after an engine step (or at the end of `LLM.generate`).

    `outputs` holds the generated sequences: one for an engine request, the prompt's `n`
    completions (`outputs[k].index == k`) from `LLM.generate`. `token_ids` / `text` are
    shortcuts to `outputs[0]`.
    """

    request_id: object
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    abort_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text
