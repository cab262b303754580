"""Turning logits into tokens for a batch of requests with different sampling parameters."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from .sampling_params import SamplingParams


@attrs.frozen(eq=False)
class SampleOutput:
    """tokens: [B] int64; logprobs: [B] fp32 log-probability of each token (None when no request
    asked); top_logprobs: per request a list of (token, logprob) of its best `logprobs` tokens."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: list[list[tuple[int, float]]] | None


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k, then outside the nucleus (top-p) of what top-k
    left, renormalised (as vLLM and Hugging Face do). logits: [B, V] fp32; top_k: [B] (<= 0:
    off); top_p: [B] (1.0: off). Ties at the boundary stay in."""
    vocab = logits.shape[-1]
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    logits = logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < p.
    # top_p >= 1 keeps all: the fp32 running sum reaches 1.0 before the last tokens (always when
    # one token dominates), which would mask them.
    before = probs.cumsum(-1) - probs
    keep_sorted = (before < top_p.unsqueeze(1)) | (top_p >= 1).unsqueeze(1)
    cutoff = sorted_logits.masked_fill(~keep_sorted, float("inf")).min(-1, keepdim=True).values
    return logits.masked_fill(logits < cutoff, float("-inf"))


class Sampler:
    """Greedy, temperature, top-k and top-p sampling with per-request seeds.

    A request with a seed draws from its own generator, so its tokens do not depend on what it
    is batched with; other requests share the sampler's generator.
    """

    def __init__(
        self,
        seed: int = 0,
        device: torch.device | str = "cpu",
        eos_token_ids: Sequence[int] = (),
    ):
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._request_generators: dict[object, torch.Generator] = {}

    def register(
        self, request_id: object, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._request_generators[request_id] = gen

    def forget(self, request_id: object) -> None:
        self._request_generators.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[object] | None = None,
    ) -> SampleOutput:
        """logits: [B, V] (any float dtype) -> one token per row."""
        logits = logits.float()
        batch = logits.shape[0]
        tokens = logits.argmax(-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
            top_k = torch.tensor([params[i].top_k for i in sampled], device=logits.device)
            top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)
            scaled = _filter(logits[rows] / temps.unsqueeze(1), top_k, top_p)
            probs = scaled.softmax(-1)
            for j, i in enumerate(sampled):
                rid = request_ids[i] if request_ids is not None else None
                gen = self._request_generators.get(rid, self.generator)
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        want = [p.logprobs for p in params]
        if all(w is None for w in want):
            return SampleOutput(tokens, None, None)
        logp = logits.log_softmax(-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top: list[list[tuple[int, float]]] = []
        for i in range(batch):
            n = want[i] or 0
            if n:
                values, ids = logp[i].topk(n)
                top.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
            else:
                top.append([])
        return SampleOutput(tokens, chosen, top)


def accept_draft(draft: Sequence[int], target: Sequence[int]) -> list[int]:
    """Speculative verification: the tokens to emit after a verify step.

    draft: the n proposed tokens fed to the verify step; target: the n + 1 tokens the sampler
    chose at each verify position (position j predicts the token after draft[j-1]). The draft
    is accepted while it agrees with the target; the first disagreement (or the bonus token
    after a full accept) comes from the target. Returns 1 .. n + 1 tokens; a caller rolls the
    request's state back to len(accepted) - 1 accepted draft tokens.
    """
    if len(target) != len(draft) + 1:
        raise ValueError(f"need len(draft) + 1 targets, got {len(draft)} and {len(target)}")
    out = []
    for proposed, chosen in zip(draft, target, strict=False):
        out.append(chosen)
        if proposed != chosen:
            return out
    out.append(target[len(draft)])
    return out
