"""`LLM`: offline batch generation, with the calling conventions vLLM users know.

from tokenspeed import LLM, SamplingParams
llm = LLM(model="tiny")                       # a preset (random weights) or a checkpoint dir
outs = llm.generate(["Hello", {"prompt_token_ids": [5, 6, 7]}],
                    SamplingParams(temperature=0, max_tokens=32))
outs[0].text, outs[1].token_ids
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenspeed.model import PRESETS, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.loader import load_checkpoint

from .chat_template import (
    ChatTemplateError,
    encode_rendered,
    find_chat_template,
    render,
    resolve_template,
    special_tokens,
)
from .config import EngineConfig
from .device import check_checkpoint_fits, check_preset_fits, resolve_device
from .engine import Engine, RequestError
from .outputs import RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer

if TYPE_CHECKING:
    from .parallel_config import ParallelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    model: str, dtype: str = "auto", device: str | torch.device = "cpu", seed: int = 0
) -> tuple[KimiForCausalLM, Tokenizer | None]:
    """A preset with seeded random weights (and a byte tokenizer) or a checkpoint directory
    (and its own tokenizer, if it ships one)."""
    device = torch.device(device)
    if model in PRESETS:
        if dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
        # Random presets default to fp32 on CPU and bf16 on GPUs.
        if dtype == "auto":
            dtype = "bfloat16" if device.type == "cuda" else "float32"
        check_preset_fits(model, _DTYPES[dtype], device)
        net = init_random_weights(KimiForCausalLM(get_preset(model)), seed=seed)
        net = net.to(device=device, dtype=_DTYPES[dtype])
        _keep_fp32(net)
        cfg = net.config
        return net, ByteTokenizer(cfg.vocab_size, eos_token_ids=cfg.eos_token_ids)
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a preset {sorted(PRESETS)} nor a directory")
    check_checkpoint_fits(path, dtype, device)
    net = load_checkpoint(path, dtype=dtype, device=device)
    return net, load_tokenizer(path, net.config.eos_token_ids)


# Decay rates and the router (its weight and correction bias) stay fp32 whatever the model
# dtype, as the loader keeps them.
FP32_SUFFIXES = ("A_log", "dt_bias", "mlp.gate.weight", "e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    """Whether the tensor of this qualified name stays fp32 in a model of any dtype."""
    return name.endswith(FP32_SUFFIXES)


def _keep_fp32(model: KimiForCausalLM) -> None:
    """Decay rates and the router stay fp32 whatever the model dtype (as the loader does)."""
    for name, param in model.named_parameters():
        if keeps_fp32(name):
            param.data = param.data.float()
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            module.e_score_correction_bias = bias.float()


OFFLINE_DECODE_STEPS = 8


class LLM:
    """A model plus an engine, for offline generation.

    model: a preset name ("tiny", ...) or a Hugging Face layout checkpoint directory.
    Remaining keyword arguments are `EngineConfig` fields (max_num_seqs, max_model_len, ...);
    decode_steps defaults to 8 here (offline generation wants throughput, not token-by-token
    streaming; see `EngineConfig.decode_steps`), 1 with `speculative=SpeculativeConfig(...)`
    (speculative decoding, docs/spec.md: one verify forward per step).
    parallel: a `ParallelConfig` to run the model over `world_size` worker processes (attention
    data parallel, experts split over them; `tokenspeed.runtime.multirank`): `self.engine` is
    then a `MultiRankEngine` (`llm.close()` stops its workers; so do a worker failure and
    interpreter exit), and generate() returns what the single-rank engine would.
    `close()`, or leaving `with LLM(...) as llm:`, releases the engine (stops the workers).
    """

    def __init__(
        self,
        model: str = "tiny",
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        parallel: ParallelConfig | None = None,
        **engine_options,
    ):
        # The preset name or checkpoint directory (`chat` reads the checkpoint's template).
        self.model_source = model
        self._closed = False
        # A speculating engine runs one verify forward per step (EngineConfig.speculative).
        speculating = engine_options.get("speculative") is not None
        engine_options.setdefault("decode_steps", 1 if speculating else OFFLINE_DECODE_STEPS)
        if speculating and parallel is not None:
            raise NotImplementedError("speculative decoding runs on a single-rank engine only")
        config = EngineConfig(device=device, seed=seed, **engine_options)
        if parallel is not None:
            # Worker processes, one rank each, behind a front end with the engine's interface
            # (add_request / step / abort / has_unfinished): generate() drives it as it is.
            from .multirank import MultiRankEngine

            self.engine = MultiRankEngine(model, parallel, config, dtype=dtype, seed=seed)
            self.tokenizer = self.engine.tokenizer
            self._ids = itertools.count()
            return
        resolved = resolve_device(config.device)
        net, tokenizer = load_model(model, dtype=dtype, device=resolved, seed=seed)
        self.tokenizer = tokenizer
        self.engine = Engine(net, tokenizer, config)
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine: a parallel LLM's worker processes are stopped (by PID), a
        single-rank engine's cache threads are stopped. Idempotent; the LLM must not generate
        afterwards."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer (as vLLM's `LLM.get_tokenizer`). A checkpoint that ships no tokenizer
        has none: this raises `TokenizerError` then (`llm.tokenizer` is None)."""
        if self.tokenizer is None:
            raise TokenizerError(
                f"model {self.model_source!r} has no tokenizer (no tokenizer.json or "
                "tiktoken.model in its directory); give prompts as {'prompt_token_ids': [...]}"
            )
        return self.tokenizer

    def _checkpoint_dir(self) -> Path | None:
        """The checkpoint directory the model came from (None for a preset)."""
        model = self.model_source
        if not isinstance(model, str | os.PathLike) or model in PRESETS:
            return None
        path = Path(model)
        return path if path.is_dir() else None

    def _encode(self, prompt, index: int = 0) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a string or {"prompt": text} (vLLM's TextPrompt),
        or {"prompt_token_ids": [...]} (its TokensPrompt; the text is then None)."""
        where = f"prompt {index}"
        if isinstance(prompt, dict):
            unknown = sorted(str(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
            if unknown:
                raise RequestError(
                    f"{where}: unsupported keys {unknown}; a prompt dict is {{'prompt': text}} "
                    "or {'prompt_token_ids': [...]}"
                )
            if not prompt:
                raise RequestError(
                    f"{where}: an empty dict; a prompt dict is {{'prompt': text}} or "
                    "{'prompt_token_ids': [...]}"
                )
            if len(prompt) == 2:
                raise RequestError(
                    f"{where}: give either 'prompt' (text) or 'prompt_token_ids', not both"
                )
            if "prompt_token_ids" in prompt:
                return None, _token_ids(prompt["prompt_token_ids"], where)
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise RequestError(
                    f"{where}: 'prompt' must be a string, got {type(prompt).__name__}"
                )
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    f"{where}: text prompts need a tokenizer; pass {{'prompt_token_ids': [...]}}"
                )
            return prompt, self.tokenizer.encode(prompt)
        raise RequestError(
            f"{where}: expected a string or a dict with 'prompt' (text) or 'prompt_token_ids' "
            f"(a list of ints), got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order, holding the prompt's `n`
        completions (`outputs[k]`, k < n; `text` and `token_ids` are those of the first).
        A prompt is a string, {"prompt": text} or {"prompt_token_ids": [...]}. A prompt the
        engine refuses raises `RequestError`, and a failed step `StepError` (see `Engine.step`),
        after the call's other requests are aborted: nothing of a failed call runs on.
        use_tqdm: show progress on stderr (tokens generated, tokens/s, requests done)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise RequestError("generate() needs at least one prompt")
        params = _params_per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]  # errors before any work
        return self._generate(encoded, params, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | Path | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (vLLM's `LLM.chat`): messages is one conversation
        (a list of {"role": ..., "content": ...}) or a list of them; each is rendered with the
        checkpoint's chat template (`chat_template.jinja` or tokenizer_config.json's
        `chat_template`), or with `chat_template` (the template's text, or a file) when given,
        as Hugging Face's `apply_chat_template` renders it (add_generation_prompt, and
        chat_template_kwargs passed to the template), then generated as `generate` does. One
        output per conversation, whose `prompt` is the rendered text."""
        if self.tokenizer is None:
            raise RequestError(
                f"chat() needs a tokenizer, and model {self.model_source!r} has none; render the "
                "prompt yourself and pass {'prompt_token_ids': [...]} to generate()"
            )
        conversations = _conversations(messages)
        params = _params_per_prompt(sampling_params, len(conversations))
        root = self._checkpoint_dir()
        try:
            if chat_template is not None:
                template = resolve_template(chat_template)
            else:
                template = find_chat_template(root) if root is not None else None
            tokens = special_tokens(root)
        except (OSError, ChatTemplateError) as exc:
            raise RequestError(f"chat template: {exc}") from exc
        if template is None:
            where = f"checkpoint {str(root)!r}" if root is not None else "this model"
            raise RequestError(
                f"{where} has no chat template (no chat_template.jinja, no 'chat_template' in "
                "tokenizer_config.json); pass one as chat(..., chat_template=...)"
            )
        extra = dict(chat_template_kwargs or {})
        encoded = []
        for i, conversation in enumerate(conversations):
            try:
                text = render(template, conversation, add_generation_prompt, tokens, **extra)
            except ChatTemplateError as exc:
                raise RequestError(f"conversation {i}: {exc}") from exc
            encoded.append((text, encode_rendered(self.tokenizer, text)))
        return self._generate(encoded, params, use_tqdm)

    def _generate(
        self,
        encoded: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Run encoded prompts (text, ids) to their ends: `n` engine requests per prompt, one
        per completion, merged into one output per prompt."""
        engine = self.engine
        limit = engine.config.max_model_len
        for index, ((_, ids), p) in enumerate(zip(encoded, params, strict=True)):
            if not ids:
                raise RequestError(f"prompt {index}: the prompt is empty")
            if len(ids) >= limit:
                raise RequestError(
                    f"prompt {index}: a prompt of {len(ids)} tokens leaves no room under "
                    f"max_model_len={limit}"
                )
            if not isinstance(p, SamplingParams):
                raise RequestError(
                    f"prompt {index}: sampling params must be SamplingParams, got {p!r}"
                )
        # (prompt index, engine request id, params): one engine request per completion.
        jobs = [
            (index, next(self._ids), child)
            for index, p in enumerate(params)
            for child in _completions(p)
        ]
        ours = {rid for _, rid, _ in jobs}
        added: list[int] = []
        results: dict[int, RequestOutput] = {}
        budgets = {rid: min(p.max_tokens, limit - len(encoded[index][1])) for index, rid, p in jobs}
        bar = _progress(budgets, use_tqdm)
        try:
            for index, rid, p in jobs:
                text, tokens = encoded[index]
                try:
                    engine.add_request(rid, tokens, p, prompt=text)
                except RequestError as exc:  # named by its place in the call, not our id
                    detail = str(exc).removeprefix(f"request {rid!r}: ")
                    raise RequestError(f"prompt {index}: {detail}") from None
                added.append(rid)
            while len(results) < len(jobs):
                for out in engine.step():
                    # Only this call's: a request added to the engine directly may finish
                    # meanwhile (generate() steps the engine, so such a request's outputs
                    # are not delivered to anyone while it runs: do not mix the two).
                    if out.request_id not in ours or out.request_id in results:
                        continue
                    if bar is not None:
                        bar.advance(out)
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            # A refused request, a failed step or an interrupt ends the call: none of its
            # requests may keep running into the next one. Step only until their aborts are
            # reported: a request added to the engine directly is not this call's to finish.
            aborting = {rid for rid in added if engine.abort(rid, "generate() failed")}
            while aborting:
                aborting -= {out.request_id for out in engine.step() if out.finished}
            raise
        finally:
            if bar is not None:
                bar.close()
        grouped: list[list[RequestOutput]] = [[] for _ in encoded]
        for index, rid, _ in jobs:
            grouped[index].append(results[rid])
        return [_merge(outs) for outs in grouped]


def _token_ids(value, where: str) -> list[int]:
    """A TokensPrompt's ids as ints (numpy ints and one-element integer tensors too)."""
    try:
        if isinstance(value, str | bytes):
            raise TypeError
        return [operator.index(t) for t in value]
    except TypeError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise RequestError(
            f"{where}: prompt_token_ids must be a list of token ids (ints), got {shown}"
        ) from None


def _params_per_prompt(sampling_params, count: int) -> list:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * count
    params = list(sampling_params)
    if len(params) != count:
        raise RequestError(
            f"{len(params)} sampling params for {count} prompts; give one, or one per prompt"
        )
    return params


def _conversations(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, checked."""
    if isinstance(messages, dict | str) or not isinstance(messages, Sequence) or not messages:
        raise RequestError(
            "chat() takes a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
            f"non-empty list of them, got {type(messages).__name__}"
        )
    batch = all(isinstance(m, list | tuple) for m in messages)
    conversations = [list(c) for c in messages] if batch else [list(messages)]
    for i, conversation in enumerate(conversations):
        if not conversation:
            raise RequestError(f"conversation {i} is empty")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(
                    f"conversation {i}, message {j}: a message is a dict with a 'role' (a "
                    f"string) and 'content', got {message!r:.80}"
                )
    return conversations


def _completions(params: SamplingParams) -> list[SamplingParams]:
    """The params of each of a prompt's n completions (vLLM's): completion k of a seeded
    request has seed + k (wrapped into the seed range), so that they differ."""
    if params.n == 1:
        return [params]
    if params.seed is None:
        return [params.evolve(n=1)] * params.n
    seeds = [params.seed + k for k in range(params.n)]
    return [params.evolve(n=1, seed=s - (1 << 64) if s >= 1 << 64 else s) for s in seeds]


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """A prompt's completions in one output: request id, prompt and metrics' start of the first,
    completion k at outputs[k]."""
    first = outs[0]
    if len(outs) == 1:
        return first
    completions = []
    for k, out in enumerate(outs):
        completion = out.outputs[0]
        completion.index = k
        completions.append(completion)
    all_metrics = [out.metrics for out in outs]

    def earliest(name):
        values = [getattr(m, name) for m in all_metrics if getattr(m, name) is not None]
        return min(values, default=None)

    def latest(name):
        values = [getattr(m, name) for m in all_metrics if getattr(m, name) is not None]
        return max(values, default=None)

    metrics = RequestMetrics(
        arrival_time=earliest("arrival_time"),
        first_scheduled_time=earliest("first_scheduled_time"),
        first_token_time=earliest("first_token_time"),
        last_token_time=latest("last_token_time"),
        finished_time=latest("finished_time"),
        cached_tokens=first.metrics.cached_tokens,
        preemptions=sum(m.preemptions for m in all_metrics),
    )
    return RequestOutput(
        request_id=first.request_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=all(out.finished for out in outs),
        metrics=metrics,
        abort_reason=next((o.abort_reason for o in outs if o.abort_reason is not None), None),
    )


class _Progress:
    """generate()'s progress bar: tokens generated out of the most the requests may generate
    (shrunk as requests end early), tokens/s, and requests done in the postfix."""

    def __init__(self, budgets: dict[object, int]):
        from tqdm.auto import tqdm

        self._budgets = budgets
        self._seen: dict[object, int] = {}
        self._done = 0
        self._bar = tqdm(
            total=sum(budgets.values()),
            desc="generate",
            unit="tok",
            dynamic_ncols=True,
            postfix=self._postfix(),
        )

    def _postfix(self) -> str:
        return f"{self._done}/{len(self._budgets)} requests"

    def advance(self, out: RequestOutput) -> None:
        rid = out.request_id
        count = len(out.outputs[0].token_ids)
        new, self._seen[rid] = count - self._seen.get(rid, 0), count
        if out.finished:
            self._done += 1
            unused = self._budgets[rid] - count
            if unused > 0:  # it ended early: the total shrinks
                self._bar.total -= unused
            self._bar.set_postfix_str(self._postfix(), refresh=False)
        self._bar.update(new)
        if out.finished and not new:
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _progress(budgets: dict[object, int], enabled: bool) -> _Progress | None:
    """Progress of generate() when enabled (use_tqdm), even for one prompt: budgets holds the
    most tokens each request may generate."""
    if not enabled:
        return None
    return _Progress(budgets)
