"""`LLM`: offline batch generation, with the calling conventions vLLM users know.

from tokenspeed import LLM, SamplingParams
llm = LLM(model="tiny")                       # a preset (random weights) or a checkpoint dir
outs = llm.generate(["Hello", {"prompt_token_ids": [5, 6, 7]}],
                    SamplingParams(temperature=0, max_tokens=32))
outs[0].text, outs[1].token_ids
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from tokenspeed.model import PRESETS, KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.loader import load_checkpoint

from .config import EngineConfig
from .device import resolve_device
from .engine import Engine, RequestError
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

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
        net = init_random_weights(KimiForCausalLM(get_preset(model)), seed=seed)
        net = net.to(device=device, dtype=_DTYPES[dtype])
        _keep_fp32(net)
        cfg = net.config
        return net, ByteTokenizer(cfg.vocab_size, eos_token_ids=cfg.eos_token_ids)
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a preset {sorted(PRESETS)} nor a directory")
    net = load_checkpoint(path, dtype=dtype, device=device)
    return net, load_tokenizer(path, net.config.eos_token_ids)


def _keep_fp32(model: KimiForCausalLM) -> None:
    """Decay rates and the router stay fp32 whatever the model dtype (as the loader does)."""
    for name, param in model.named_parameters():
        if name.endswith(("A_log", "dt_bias", "mlp.gate.weight")):
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
    streaming; see `EngineConfig.decode_steps`).
    """

    def __init__(
        self,
        model: str = "tiny",
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        **engine_options,
    ):
        engine_options.setdefault("decode_steps", OFFLINE_DECODE_STEPS)
        config = EngineConfig(device=device, seed=seed, **engine_options)
        resolved = resolve_device(config.device)
        net, tokenizer = load_model(model, dtype=dtype, device=resolved, seed=seed)
        self.tokenizer = tokenizer
        self.engine = Engine(net, tokenizer, config)
        self._ids = itertools.count()

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "text prompts need a tokenizer; pass {'prompt_token_ids': [...]}"
                )
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise RequestError(
            f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order. A prompt the engine refuses raises
        `RequestError`, and a failed step `StepError` (see `Engine.step`), after the call's
        other requests are aborted: nothing of a failed call runs on."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise RequestError("generate() needs at least one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise RequestError(
                    f"{len(params)} sampling params for {len(prompts)} prompts; "
                    "give one, or one per prompt"
                )
        encoded = [self._encode(p) for p in prompts]  # all errors before any work starts
        engine = self.engine
        limit = engine.config.max_model_len
        for (_, ids), p in zip(encoded, params, strict=True):
            if not ids:
                raise RequestError("a prompt is empty")
            if len(ids) >= limit:
                raise RequestError(
                    f"a prompt of {len(ids)} tokens leaves no room under max_model_len={limit}"
                )
            if not isinstance(p, SamplingParams):
                raise RequestError(f"sampling params must be SamplingParams, got {p!r}")
        ids = [next(self._ids) for _ in prompts]
        ours = set(ids)
        added: list[int] = []
        results: dict[int, RequestOutput] = {}
        bar = _progress(len(prompts), use_tqdm)
        try:
            requests = zip(ids, encoded, params, strict=True)
            for index, (rid, (text, tokens), p) in enumerate(requests):
                try:
                    engine.add_request(rid, tokens, p, prompt=text)
                except RequestError as exc:  # named by its place in the call, not our id
                    detail = str(exc).removeprefix(f"request {rid!r}: ")
                    raise RequestError(f"prompt {index}: {detail}") from None
                added.append(rid)
            while len(results) < len(ids):
                for out in engine.step():
                    # Only this call's: a request added to the engine directly may finish
                    # meanwhile (generate() steps the engine, so such a request's outputs
                    # are not delivered to anyone while it runs: do not mix the two).
                    if out.finished and out.request_id in ours and out.request_id not in results:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
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
        return [results[rid] for rid in ids]


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
