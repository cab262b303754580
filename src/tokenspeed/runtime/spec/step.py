"""`SpeculativeStep`: a speculating engine's decode step (docs/spec.md, section 5).

The engine holds one when `EngineConfig.speculative` is set and hands it every decode batch
(`run`) and, with EAGLE3, every prefill forward's auxiliary hidden states (`prefilled`). It owns
the proposer, picks each row's drafts, runs one verify forward over each row's last token and
drafts, accepts, rolls the KDA states back to each row's last kept token, commits the emitted
tokens to the requests and the scheduler token by token, and records the acceptance metrics.

It reaches the rest of the engine through the engine itself (`host`), reading at each call:
`port`, `runner`, `sampler`, `scheduler`, `keeper`, `metrics` (replaced by `reset_metrics`)
and `_accept` (the engine's host bookkeeping of sampled tokens).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from tokenspeed.sched import DecodeBatch, StepPlan

from ..sampler import SampleOutput
from .acceptance import verify
from .config import SpeculativeConfig
from .eagle3 import Eagle3Drafts
from .proposer import NgramDrafts, Proposer


def speculable(params) -> bool:
    """Whether a request's decode rows may be speculated: not with penalties or min_tokens
    (their logits depend on outputs not yet known at the verify positions) nor logprobs."""
    return not (params.penalized or params.min_tokens > 0 or params.logprobs is not None)


class SpeculativeStep:
    """The speculative decode step of one engine. `proposer`: the per-request `Proposer`
    (n-gram by default; a test or tool may put its own in before adding requests), None with
    an EAGLE3 drafter (`drafter`), which drafts for the whole batch at once."""

    def __init__(
        self, config: SpeculativeConfig, host, page_size: int, drafter: Eagle3Drafts | None = None
    ) -> None:
        self.config = config
        self.host = host
        self.page_size = page_size
        self.drafter = drafter
        self.proposer: Proposer | None = (
            None
            if drafter is not None
            else NgramDrafts(config.min_n, config.max_n, config.num_steps)
        )

    @classmethod
    def build(cls, host, drafter, num_pages: int) -> SpeculativeStep | None:
        """The step of engine `host` (None when its config does not speculate); drafter: the
        EAGLE3 drafter (`eagle3.load_drafter`), its KV pool of the cache's `num_pages` pages."""
        config = host.config
        if config.speculative is None:
            return None
        drafts = None
        if drafter is not None:
            drafts = Eagle3Drafts(drafter, num_pages, config.page_size, host.device)
        return cls(config.speculative, host, config.page_size, drafts)

    # ------------------------------------------------------------------ the engine's hooks
    def prefilled(self, rids: Sequence[Hashable], starts: Sequence[int], lens: Sequence[int]):
        """A prefill forward computed lens[i] tokens of rids[i] from position starts[i]; with
        EAGLE3 the drafter is handed their auxiliary states (the runner's last forward's)."""
        if self.drafter is None:
            return
        aux = self.host.runner.aux_hidden
        offset = 0
        for rid, start, n in zip(rids, starts, lens, strict=True):
            if speculable(self.host._records[rid].params):
                self.drafter.observe(rid, start, aux[offset : offset + n])
            offset += n

    def forget(self, rid: Hashable) -> None:
        if self.proposer is not None:
            self.proposer.forget(rid)
        if self.drafter is not None:
            self.drafter.forget(rid)

    def run(self, batch: DecodeBatch, records, moved) -> bool:
        """One decode step of `batch` if it speculates; returns whether it ran it (then it also
        reported the rows to the scheduler). False: the engine runs a plain decode step."""
        port = self.host.port
        drafts, probs = self._drafts(batch, records)
        if not any(drafts) and self.drafter is None:
            # An earlier verify step may have reserved this page's length already, and then
            # the scheduler's reservation handed the cache no keys: hand them over here.
            for record in records:
                port.sync_keys(record.sched)
            return False
        # With EAGLE3 every step verifies (rows without drafts: windows of one token), so that
        # the drafter gets the target's auxiliary states of every position.
        self._verify(batch, records, drafts, probs, moved)
        return True

    # ------------------------------------------------------------------ drafts
    def _room(self, record) -> int:
        """How many tokens a decode row may draft this step (0: it decodes plainly).

        Not speculated: requests that are not `speculable`. The window (the row's last token
        and its drafts) never crosses a page boundary: it ends at the end of the page holding
        the row's next position at the latest, so a verify step writes only the page the
        scheduler reserved for the plain step, the only page boundary its kept tokens can reach
        is the window's end (where the rolled-back live state is), and KDA rolling checkpoints
        are taken exactly as in plain decoding. Nor does it run past the row's max_tokens. A
        row one token short of a boundary decodes plainly that step."""
        if not speculable(record.params):
            return 0
        req, page = record.sched, self.page_size
        room = min(page - req.num_computed % page, req.max_new_tokens - req.num_output)
        return max(0, min(self.config.num_steps, room - 1))

    def _drafts(self, batch, records) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Each row's drafts ([]: it decodes plainly) and, for sampled EAGLE3 rows, the
        distributions [k, vocab] they were drawn from (None: point masses)."""
        ks = [self._room(r) for r in records]
        if self.drafter is not None:
            host = self.host
            handles = [host.port.handle(r.rid) for r in batch.requests]
            table = host.runner.pools.page_table_tensor(handles, device=host.runner.device)
            gens = [host.sampler.generator_for(r.rid) for r in records]
            return self.drafter.propose(records, ks, table, gens)
        drafts = []
        for record, k in zip(records, ks, strict=True):
            draft = list(self.proposer.propose(record.rid, record.tokens, k))[:k] if k else []
            if k and self.config.forced_acceptance is not None and len(draft) < k:
                # BENCHMARK ONLY: filler drafts, so that every row accepts the forced length.
                draft += [record.tokens[-1]] * (k - len(draft))
            drafts.append(draft)
        return drafts, [None] * len(records)

    # ------------------------------------------------------------------ verify
    def _verify(self, batch, records, drafts, probs, moved) -> None:
        """One verify forward over each row's last token and its drafts, acceptance, the KDA
        rollback to each row's last kept token, then the emitted tokens committed. Rows without
        drafts are sampled as in a plain step (their one row of logits)."""
        host = self.host
        reqs = batch.requests
        handles = [host.port.handle(r.rid) for r in reqs]
        base = [r.sched.num_computed for r in records]
        inputs = [[r.tokens[n], *d] for r, n, d in zip(records, base, drafts, strict=True)]
        for record, n, row in zip(records, base, inputs, strict=True):
            # The window lies in the page already reserved (see `_room`): this extends the
            # reservation's length over it without a new page, as a multi-step run's does.
            if len(row) > 1 and not host.port.reserve(record.sched, n + len(row)):
                raise RuntimeError(f"request {record.rid!r}: verify window outside its pages")
        step = host.runner.verify(inputs, base, handles)
        logits = step.logits
        emitted: list[list[int]] = [[] for _ in records]
        plain = [i for i, d in enumerate(drafts) if not d]
        spec = [i for i, d in enumerate(drafts) if d]
        plain_out = None
        if plain:
            rows = torch.tensor([step.rows(i).start for i in plain], device=logits.device)
            plain_out = host.sampler.sample(
                logits[rows], [records[i].params for i in plain], [records[i].rid for i in plain]
            )
            for j, token in zip(plain, plain_out.tokens.tolist(), strict=True):
                emitted[j] = [token]
        if spec:
            result = self._accept(step, records, drafts, probs, spec)
            for i, tokens in zip(spec, result.to_lists(), strict=True):
                emitted[i] = tokens
                host.metrics.record_verify(len(drafts[i]), len(tokens))
        # The live KDA states now cover every fed token: keep each row's first len(emitted)
        # (its last token and the accepted drafts; the last emitted token is the next input).
        host.runner.rollback(step, [len(e) for e in emitted])
        if self.drafter is not None:  # the kept rows' auxiliary states, for the next drafts
            for i, (record, n) in enumerate(zip(records, base, strict=True)):
                if speculable(record.params):
                    rows = step.rows(i)
                    self.drafter.observe(
                        record.rid, n, step.aux[rows.start : rows.start + len(emitted[i])]
                    )
        self._commit(batch, records, base, emitted, plain_out, plain, moved)

    def _accept(self, step, records, drafts, probs, spec):
        """`verify` over the rows with drafts, padded to the longest."""
        logits = step.logits
        k = max(len(drafts[i]) for i in spec)
        padded = logits.new_zeros(len(spec), k + 1, logits.shape[-1])
        draft = torch.zeros(len(spec), k, dtype=torch.long, device=logits.device)
        for j, i in enumerate(spec):
            n = len(drafts[i])
            padded[j, : n + 1] = logits[step.rows(i)]
            draft[j, :n] = torch.tensor(drafts[i], dtype=torch.long)
        draft_probs = None
        if any(probs[i] is not None for i in spec):
            # Rows drafted deterministically (and the padding) are point masses.
            draft_probs = torch.zeros(len(spec), k, logits.shape[-1], device=logits.device)
            draft_probs.scatter_(2, draft.unsqueeze(2), 1.0)
            for j, i in enumerate(spec):
                if probs[i] is not None:
                    draft_probs[j, : len(drafts[i])] = probs[i]
        return verify(
            draft,
            padded,
            [records[i].params for i in spec],
            num_draft=[len(drafts[i]) for i in spec],
            draft_probs=draft_probs,
            generators=[self.host.sampler.generator_for(records[i].rid) for i in spec],
            forced_length=self.config.forced_acceptance,
        )

    def _commit(self, batch, records, base, emitted, plain_out, plain, moved) -> None:
        """Append a verify step's emitted tokens and report them to the scheduler token by
        token, as a multi-step run reports its steps: a row that stops at its j-th token ends
        there (the tokens after it are dropped; its live state past them is released with it)."""
        host = self.host
        last = [r.metrics.last_token_time for r in records]
        counts = [len(r.output_ids) for r in records]
        no_logprobs = SampleOutput(None, None, None)
        plain_row = {i: j for j, i in enumerate(plain)}
        alive = list(range(len(records)))
        for j in range(max(len(e) for e in emitted)):
            rows = [i for i in alive if j < len(emitted[i])]
            if not rows:
                break
            finished: set[Hashable] = set()
            for i in rows:
                host.port.sync_keys(records[i].sched)
            with_logprobs = [i for i in rows if i in plain_row]
            others = [i for i in rows if i not in plain_row]
            if with_logprobs:
                host._accept(
                    [records[i] for i in with_logprobs],
                    [emitted[i][j] for i in with_logprobs],
                    plain_out,
                    [plain_row[i] for i in with_logprobs],
                    moved,
                    finished,
                    itl=False,
                )
            if others:
                host._accept(
                    [records[i] for i in others],
                    [emitted[i][j] for i in others],
                    no_logprobs,
                    [0] * len(others),
                    moved,
                    finished,
                    itl=False,
                )
            # Token j of row i is at position base + j: a page boundary there is reachable only
            # at the row's last emitted token (see `_room`), where its live state is now.
            host.keeper.decoded([records[i].rid for i in rows], [base[i] + j for i in rows])
            sub = DecodeBatch(tuple(records[i].sched for i in rows), batch.padded_size, 1)
            host.scheduler.complete(
                StepPlan(prefill=None, decode=sub),
                finished=finished,
                save_state=host.keeper.save_state,
            )
            alive = [i for i in rows if records[i].finish_reason is None]
        for record, prev, n in zip(records, last, counts, strict=True):
            m = record.metrics
            host.metrics.record_run_itls(
                prev, m.first_token_time, m.last_token_time, len(record.output_ids) - n
            )
