"""Verifying drafted tokens against the target: which of them to keep, and the token after.

A verify step feeds the target, per request, its last token and k drafted tokens d_1..d_k; the
target's distributions p_0..p_k at those k + 1 positions decide (p_j predicts the token after
d_j, p_0 the one after the last token). Each request emits 1..k + 1 tokens: the accepted drafts
and one more from the target, so a step is never worse than plain decoding.

- Greedy (temperature 0): drafts are kept while they equal the target's argmax; the first
  disagreement, or the bonus token after a full accept, is the target's argmax
  (`greedy_accept`; `accept_draft` is the one-request form on lists).
- Sampling (temperature > 0): speculative sampling (Leviathan et al., Chen et al.), which keeps
  the target's distribution exactly: d_j is accepted with probability min(1, p_j(d_j) /
  q_j(d_j)); at the first rejection the token is drawn from norm(max(0, p_j - q_j)); after a full
  accept, the bonus token from p_k (`rejection_accept`). q_j is the drafter's distribution d_j
  was drawn from; a deterministic proposer (n-gram, a greedy drafter) is a point mass, so
  d_j is accepted with probability p_j(d_j) and a rejection draws from p_j without d_j.
- `forced_acceptance` (BENCHMARK ONLY: its output is not the model's) accepts exactly a given
  number of drafts per step whatever the target says, to time a fixed acceptance length.

`verify` does all of it for a batch of requests with their `SamplingParams`. Batches are
padded: draft [B, k] with num_draft [B] drafts per row (the rest padding), and the result's
tokens [B, k + 1] padded with -1. The math is batched torch; only the random draws loop over
rows that have their own generator (GPU: one kernel over the batch would draw them, with the
per-request seeds as its state, as vLLM's rejection sampler does).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

PAD = -1


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


@attrs.frozen(eq=False)
class Acceptance:
    """tokens: [B, k + 1] int64 the tokens each request emits, left-aligned, padded with -1;
    num_emitted: [B] int64, 1..num_draft + 1. Row b keeps its first num_emitted[b] - 1 drafts
    (`num_accepted`): the engine rolls its state back to those, then appends every emitted
    token to its history."""

    tokens: torch.Tensor
    num_emitted: torch.Tensor

    @property
    def num_accepted(self) -> torch.Tensor:
        """[B] drafts kept per request."""
        return self.num_emitted - 1

    def to_lists(self) -> list[list[int]]:
        """The emitted tokens per request (one read from the device)."""
        tokens, counts = self.tokens.tolist(), self.num_emitted.tolist()
        return [row[:n] for row, n in zip(tokens, counts, strict=True)]


def _num_draft(draft: torch.Tensor, num_draft) -> torch.Tensor:
    """[B] int64 on draft's device, each in 0..k."""
    if draft.dim() != 2:
        raise ValueError(f"draft must be [B, k], got shape {tuple(draft.shape)}")
    size, k = draft.shape
    if num_draft is None:
        return torch.full((size,), k, dtype=torch.int64, device=draft.device)
    counts = torch.as_tensor(num_draft, dtype=torch.int64, device=draft.device)
    if tuple(counts.shape) != (size,):
        raise ValueError(f"num_draft must be [{size}], got shape {tuple(counts.shape)}")
    if size and (int(counts.min()) < 0 or int(counts.max()) > k):
        raise ValueError(f"num_draft must be in 0..{k}, got {counts.tolist()}")
    return counts


def _emit(draft: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> Acceptance:
    """Rows of draft[:accepted] + [last], padded. draft [B, k]; accepted, last: [B]."""
    size, k = draft.shape
    column = torch.arange(k + 1, device=draft.device).unsqueeze(0)
    padded = torch.cat([draft, draft.new_full((size, 1), PAD)], dim=1)
    cut = accepted.unsqueeze(1)
    tokens = torch.where(column < cut, padded, torch.where(column == cut, last.unsqueeze(1), PAD))
    return Acceptance(tokens=tokens, num_emitted=accepted + 1)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] the length of each row's all-True prefix."""
    return mask.to(torch.int64).cumprod(dim=1).sum(dim=1)


def greedy_accept(
    draft: torch.Tensor, target: torch.Tensor, num_draft: Sequence[int] | torch.Tensor | None = None
) -> Acceptance:
    """Exact-match acceptance. draft: [B, k] int64; target: [B, k + 1] the target's choice at
    each verify position (its argmax); num_draft: [B] real drafts per row (None: all k)."""
    counts = _num_draft(draft, num_draft)
    size, k = draft.shape
    if tuple(target.shape) != (size, k + 1):
        raise ValueError(f"target must be [{size}, {k + 1}], got shape {tuple(target.shape)}")
    column = torch.arange(k, device=draft.device).unsqueeze(0)
    agree = (draft == target[:, :k]) & (column < counts.unsqueeze(1))
    accepted = _leading_true(agree)
    last = target.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return _emit(draft, accepted, last)


def forced_acceptance(
    draft: torch.Tensor,
    target: torch.Tensor,
    length: int,
    num_draft: Sequence[int] | torch.Tensor | None = None,
) -> Acceptance:
    """BENCHMARK ONLY: accept exactly min(length, num_draft) drafts per row, whatever the
    target says, then the target's token at that position. The output is not the model's; it
    exists to time the engine at a fixed acceptance length. draft: [B, k]; target: [B, k + 1]."""
    counts = _num_draft(draft, num_draft)
    size, k = draft.shape
    if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= k:
        raise ValueError(f"forced acceptance length must be in 0..{k}, got {length!r}")
    if tuple(target.shape) != (size, k + 1):
        raise ValueError(f"target must be [{size}, {k + 1}], got shape {tuple(target.shape)}")
    accepted = counts.clamp(max=length)
    last = target.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return _emit(draft, accepted, last)


Generators = torch.Generator | Sequence[torch.Generator | None] | None


def _uniform(shape: tuple[int, int], generators: Generators, device) -> torch.Tensor:
    """[B, k] uniforms in [0, 1): from one generator for the batch, or row b from generators[b]
    (None: torch's default)."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(shape, generator=generators, device=device)
    if len(generators) != shape[0]:
        raise ValueError(f"{len(generators)} generators for {shape[0]} requests")
    rows = [torch.rand(shape[1], generator=g, device=device) for g in generators]
    return torch.stack(rows) if rows else torch.empty(shape, device=device)


def _draw(probs: torch.Tensor, generators: Generators) -> torch.Tensor:
    """[B, V] distributions -> [B] one token each (same generators as `_uniform`)."""
    if generators is None or isinstance(generators, torch.Generator):
        if probs.shape[0] == 0:
            return torch.empty(0, dtype=torch.int64, device=probs.device)
        return torch.multinomial(probs, 1, generator=generators).squeeze(1)
    drawn = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
    return torch.cat(drawn) if drawn else torch.empty(0, dtype=torch.int64, device=probs.device)


def rejection_accept(
    draft: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    num_draft: Sequence[int] | torch.Tensor | None = None,
    generators: Generators = None,
) -> Acceptance:
    """Speculative sampling, batched. draft: [B, k] int64 (row b's first num_draft[b] are real);
    target_probs: [B, k + 1, V] the target's (filtered, tempered) distributions at the verify
    positions; draft_probs: [B, k, V] the distributions the drafts were drawn from (over the
    target's ids), None: point masses (a deterministic proposer); generators: one for the
    batch, one per row (a seeded request's own: its draws do not depend on its batch), or None.

    Each row consumes the same draws whatever happens: k uniforms, then one token."""
    counts = _num_draft(draft, num_draft)
    size, k = draft.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (size, k + 1):
        raise ValueError(
            f"target_probs must be [{size}, {k + 1}, V], got shape {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (size, k, vocab):
        raise ValueError(
            f"draft_probs must be [{size}, {k}, {vocab}], got shape {tuple(draft_probs.shape)}"
        )
    p = target_probs.float()
    index = draft.clamp(0, vocab - 1).unsqueeze(-1)  # padding may be any id
    p_x = p[:, :k].gather(-1, index).squeeze(-1)  # [B, k]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.float().gather(-1, index)
    q_x = q_x.reshape(size, k)
    u = _uniform((size, k), generators, p.device)
    column = torch.arange(k, device=draft.device).unsqueeze(0)
    keep = (u * q_x < p_x) & (column < counts.unsqueeze(1))
    accepted = _leading_true(keep)

    # The token after the accepted drafts: at a rejection from norm(max(0, p - q)), after a
    # full accept (accepted == num_draft) from p itself.
    rows = torch.arange(size, device=p.device)
    p_next = p[rows, accepted]  # [B, V]
    rejected = accepted < counts
    at = accepted.clamp(max=max(k - 1, 0))
    if draft_probs is None:
        q_next = torch.zeros_like(p_next)
        if k:
            q_next.scatter_(1, index[rows, at], 1.0)
    else:
        q_next = draft_probs.float()[rows, at] if k else torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(rejected.unsqueeze(1), residual, p_next)
    # p == q up to rounding leaves no mass: such a rejection has probability ~0; fall back to p.
    empty = residual.sum(-1, keepdim=True) <= 1e-12
    residual = torch.where(empty, p_next, residual)
    last = _draw(residual / residual.sum(-1, keepdim=True), generators)
    return _emit(draft, accepted, last)


def target_probs(logits: torch.Tensor, params: Sequence) -> torch.Tensor:
    """The target's distributions at verify positions, as the sampler draws from them:
    logits [B, n, V] -> [B, n, V] fp32, row b tempered and top-k / top-p filtered by params[b]
    (`SamplingParams`); a greedy row is a point mass at its argmax (so rejection sampling
    reduces to exact-match acceptance there). Penalties and min_tokens are not applied: a
    request that has them must not be speculated yet."""
    from ..sampler import _filter  # the sampler re-exports accept_draft from here

    size, n, vocab = logits.shape
    if len(params) != size:
        raise ValueError(f"{len(params)} sampling params for {size} requests")
    logits = logits.float()
    probs = torch.zeros_like(logits)
    greedy = [b for b, sp in enumerate(params) if sp.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        probs[rows] = torch.nn.functional.one_hot(logits[rows].argmax(-1), vocab).float()
    sampled = [b for b, sp in enumerate(params) if not sp.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)

        def per_token(values):
            return torch.tensor(values, device=logits.device).repeat_interleave(n)

        temps = per_token([params[b].temperature for b in sampled])
        top_k = per_token([params[b].top_k for b in sampled])
        top_p = per_token([params[b].top_p for b in sampled])
        scores = logits[rows].reshape(-1, vocab) / temps.unsqueeze(1)
        probs[rows] = _filter(scores, top_k, top_p).softmax(-1).reshape(len(sampled), n, vocab)
    return probs


def verify(
    draft: torch.Tensor,
    logits: torch.Tensor,
    params: Sequence,
    num_draft: Sequence[int] | torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    generators: Generators = None,
    forced_length: int | None = None,
) -> Acceptance:
    """The verify step's acceptance for a batch: draft [B, k]; logits [B, k + 1, V] the target's
    at the verify positions; params: each request's `SamplingParams`; draft_probs: [B, k, V]
    (None: the proposer is deterministic). An all-greedy batch takes the exact-match path
    without building distributions. forced_length: BENCHMARK ONLY, `forced_acceptance`
    against the target's argmax."""
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (draft.shape[0], draft.shape[1] + 1):
        raise ValueError(
            f"logits must be [{draft.shape[0]}, {draft.shape[1] + 1}, V], got shape "
            f"{tuple(logits.shape)}"
        )
    if len(params) != draft.shape[0]:
        raise ValueError(f"{len(params)} sampling params for {draft.shape[0]} requests")
    if forced_length is not None:
        return forced_acceptance(draft, logits.argmax(-1), forced_length, num_draft)
    if all(sp.greedy for sp in params):
        return greedy_accept(draft, logits.argmax(-1), num_draft)
    return rejection_accept(draft, target_probs(logits, params), draft_probs, num_draft, generators)
