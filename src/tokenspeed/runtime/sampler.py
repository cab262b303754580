"""Turning logits into tokens for a batch of requests with different sampling parameters."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from .sampling_params import SamplingParams
from .spec.acceptance import accept_draft as accept_draft  # moved there; re-exported


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


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's (and OpenAI's) penalties, out of place. logits: [P, V] fp32; output_counts: [P, V]
    how often each token is in the row's output; prompt_mask: [P, V] bool, the tokens of its
    prompt (None: no row has a repetition penalty); presence, frequency, repetition: [P].

    A token in the prompt or the output has its logit divided by the repetition penalty when
    positive, multiplied by it otherwise; then logit -= frequency * count + presence * (count >
    0). Penalties that are off (1.0, 0.0, 0.0) leave a row's logits exactly as they were."""
    in_output = output_counts > 0
    seen = in_output if prompt_mask is None else in_output | prompt_mask
    penalty = repetition.unsqueeze(1)
    repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = torch.where(seen, repeated, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * in_output


@attrs.define(eq=False)
class _Tracked:
    """A request whose logits depend on its own output (penalties, min_tokens): what the sampler
    keeps of it. sampled: tokens sampled for it so far (its output's length: the engine samples
    each output token once); slot: its row of the sampler's output-count table, once it has one."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]
    sampled: int = 0
    slot: int | None = None


class Sampler:
    """Greedy, temperature, top-k and top-p sampling with per-request seeds, penalties and
    min_tokens.

    A request with a seed draws from its own generator, so its tokens do not depend on what it
    is batched with; other requests share the sampler's generator.

    Penalties and min_tokens need the request registered (`register`, with its prompt ids) and
    its id passed to `sample`: the sampler counts each such request's output tokens itself, on
    the device, from the tokens it samples (multi-step decoding never brings them to the host
    between steps). Rows without them take the plain path: nothing touches their logits.
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
        self._tracked: dict[object, _Tracked] = {}
        # Output token counts [slots, V] and prompt masks [slots, V] of penalized requests, made
        # when the first one is sampled (the vocabulary is the logits' width); free slots.
        self._counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        self._free: list[int] = []

    def register(
        self, request_id: object, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._request_generators[request_id] = gen
        self._release(request_id)
        if params.penalized or params.min_tokens > 0:
            self._tracked[request_id] = _Tracked(params, tuple(prompt_token_ids))

    def generator_for(self, request_id: object) -> torch.Generator:
        """The generator a request's draws come from: its own (a seeded request), else the
        sampler's (a speculative verify step draws its acceptance from it)."""
        return self._request_generators.get(request_id, self.generator)

    def forget(self, request_id: object) -> None:
        self._request_generators.pop(request_id, None)
        self._release(request_id)

    def _release(self, request_id: object) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and tracked.slot is not None:
            self._free.append(tracked.slot)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[object] | None = None,
    ) -> SampleOutput:
        """logits: [B, V] (any float dtype) -> one token per row. Penalties and min_tokens
        apply to the rows of registered requests that have them (the caller's logits are not
        modified); logprobs are taken from the logits as given."""
        logits = logits.float()
        batch = logits.shape[0]
        tracked = self._tracked_rows(params, request_ids)
        scores = self._adjust(logits, params, tracked) if tracked else logits
        tokens = scores.argmax(-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
            top_k = torch.tensor([params[i].top_k for i in sampled], device=logits.device)
            top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)
            scaled = _filter(scores[rows] / temps.unsqueeze(1), top_k, top_p)
            probs = scaled.softmax(-1)
            for j, i in enumerate(sampled):
                rid = request_ids[i] if request_ids is not None else None
                gen = self._request_generators.get(rid, self.generator)
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        if tracked:
            self._count(tracked, tokens)
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

    def _tracked_rows(
        self, params: Sequence[SamplingParams], request_ids: Sequence[object] | None
    ) -> list[tuple[int, _Tracked]]:
        """(row, state) of the batch's requests with penalties or min_tokens."""
        if not self._tracked:
            needing = [i for i, p in enumerate(params) if p.penalized or p.min_tokens > 0]
            if not needing:
                return []
        rows = []
        for i, p in enumerate(params):
            state = None if request_ids is None else self._tracked.get(request_ids[i])
            if state is not None:
                rows.append((i, state))
            elif p.penalized or p.min_tokens > 0:
                rid = None if request_ids is None else request_ids[i]
                raise ValueError(
                    f"row {i} (request {rid!r}) has penalties or min_tokens: they need the "
                    "request registered (Sampler.register) and its id passed to sample()"
                )
        return rows

    def _adjust(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        tracked: list[tuple[int, _Tracked]],
    ) -> torch.Tensor:
        """The logits with min_tokens masks and penalties applied to the tracked rows (a copy
        when any applies; other rows keep their values exactly)."""
        vocab, device = logits.shape[-1], logits.device
        banned_rows, banned_ids = [], []
        for i, state in tracked:
            if state.sampled < params[i].min_tokens:
                stops = {*self.eos_token_ids, *params[i].stop_token_ids}
                ids = sorted(t for t in stops if 0 <= t < vocab)
                banned_rows += [i] * len(ids)
                banned_ids += ids
        penalized = [(i, state) for i, state in tracked if params[i].penalized]
        if not banned_rows and not penalized:
            return logits
        logits = logits.clone()
        if banned_rows:
            where = (
                torch.tensor(banned_rows, device=device),
                torch.tensor(banned_ids, device=device),
            )
            logits.index_put_(where, torch.tensor(float("-inf"), device=device))
        if penalized:
            rows = torch.tensor([i for i, _ in penalized], device=device)
            slots = [self._slot(state, vocab) for _, state in penalized]
            slots = torch.tensor(slots, device=device)
            chosen = [params[i] for i, _ in penalized]
            repetition = any(p.repetition_penalty != 1 for p in chosen)
            logits[rows] = apply_penalties(
                logits[rows],
                self._counts[slots],
                self._prompt_mask[slots] if repetition else None,
                torch.tensor([p.presence_penalty for p in chosen], device=device),
                torch.tensor([p.frequency_penalty for p in chosen], device=device),
                torch.tensor([p.repetition_penalty for p in chosen], device=device),
            )
        return logits

    def _slot(self, state: _Tracked, vocab: int) -> int:
        """The request's row of the count table, made on its first sampling: zero counts, its
        prompt's tokens marked."""
        if state.slot is not None:
            return state.slot
        if self._counts is None or self._counts.shape[1] != vocab:
            if self._counts is not None and any(t.slot is not None for t in self._tracked.values()):
                raise ValueError(f"logits of {vocab} tokens after {self._counts.shape[1]}")
            self._counts = torch.zeros(0, vocab, device=self.device)
            self._prompt_mask = torch.zeros(0, vocab, dtype=torch.bool, device=self.device)
            self._free = []
        if not self._free:  # grow the tables (doubling), keeping the rows in use
            old = self._counts.shape[0]
            new = max(4, 2 * old)
            self._counts = torch.cat([self._counts, self._counts.new_zeros(new - old, vocab)])
            self._prompt_mask = torch.cat(
                [self._prompt_mask, self._prompt_mask.new_zeros(new - old, vocab)]
            )
            self._free = list(range(new - 1, old - 1, -1))
        slot = self._free.pop()
        self._counts[slot].zero_()
        self._prompt_mask[slot].zero_()
        ids = [t for t in state.prompt_ids if 0 <= t < vocab]
        if ids:
            self._prompt_mask[slot, torch.tensor(ids, device=self.device)] = True
        state.slot = slot
        return slot

    def _count(self, tracked: list[tuple[int, _Tracked]], tokens: torch.Tensor) -> None:
        """Take the tokens just sampled into the tracked requests' counts (on the device)."""
        rows, slots = [], []
        for i, state in tracked:
            state.sampled += 1
            if state.slot is not None:
                rows.append(i)
                slots.append(state.slot)
        if rows:
            device = self._counts.device
            where = (
                torch.tensor(slots, device=device),
                tokens[torch.tensor(rows, device=tokens.device)].to(device),
            )
            self._counts.index_put_(where, torch.ones(len(rows), device=device), accumulate=True)
