"""A minimal greedy generation loop over the model (tests, the `tiny` demo).

The serving engine (scheduler, cache, CUDA graphs, sampling) lives in `tokenspeed.runtime`; this
loop only strings forward steps together: one packed prefill, then batched one-token decodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .batch import ForwardBatch, as_int
from .kimi import KimiForCausalLM
from .state import DecoderState


@torch.no_grad()
def greedy_generate(
    model: KimiForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Greedy continuations of `prompts` (token ids), at most `max_new_tokens` each.

    A request stops after emitting one of `stop_token_ids` (default: the config's EOS ids).
    """
    max_new_tokens = as_int(max_new_tokens, "max_new_tokens", ValueError)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    # torch.tensor(..., dtype=long) would truncate float ids and take bools for 0 and 1.
    prompts = [
        [as_int(t, f"prompts[{i}][{j}]", ValueError) for j, t in enumerate(prompt)]
        for i, prompt in enumerate(prompts)
    ]
    if stop_token_ids is None:
        stop_token_ids = model.config.eos_token_ids
    stops = {as_int(t, f"stop_token_ids[{i}]", ValueError) for i, t in enumerate(stop_token_ids)}
    device = model.lm_head.weight.device
    outputs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0:
        return outputs
    batch = ForwardBatch.build([len(p) for p in prompts], device=device)
    tokens = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    out = model(tokens, batch, model.empty_state(len(prompts)), batch.last_token_indices)
    states = out.state.split()
    active = list(range(len(prompts)))
    next_tokens = out.logits.argmax(-1).tolist()
    while True:
        still = []
        for req, token in zip(active, next_tokens, strict=True):
            outputs[req].append(token)
            if token not in stops and len(outputs[req]) < max_new_tokens:
                still.append(req)
        if not still:
            return outputs
        state = DecoderState.concat([states[r] for r in still])
        batch = ForwardBatch.build([1] * len(still), state.num_tokens, device=device)
        tokens = torch.tensor([outputs[r][-1] for r in still], dtype=torch.long, device=device)
        out = model(tokens, batch, state)
        for req, new in zip(still, out.state.split(), strict=True):
            states[req] = new
        active, next_tokens = still, out.logits.argmax(-1).tolist()
