"""`Engine`: scheduler + cache + model runner in one step loop.

    engine = Engine(model, tokenizer, EngineConfig(...))
    engine.add_request("a", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():   # RequestOutput of every request that moved
            ...

One engine serves one device. Requests that share a prefix with earlier turns (same chained page
keys) start from the cached pages and KDA checkpoint; turn ends are published to the host tier
(L2) so a later turn hits even after the device tier evicted them; under memory pressure the
scheduler preempts requests (their progress checkpointed and published) and they resume later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence

import torch

from tokenspeed.cache import CacheManager, HostCache, KeyChain, LocalHostCache
from tokenspeed.model import KimiForCausalLM
from tokenspeed.sched import (
    AggregatedScheduler,
    Request,
    SchedulerConfig,
    StepPlan,
)
from tokenspeed.sched.cache_adapter import CacheManagerPort

from .cache_sizing import fit_config, plan_cache
from .config import EngineConfig
from .device import apply_cpu_threads, resolve_device
from .graphs import DecodeGraphConfig
from .kda_keeper import KdaStateKeeper
from .load import LoadSnapshot, engine_load
from .metrics import EngineMetrics
from .outputs import RequestMetrics, RequestOutput
from .request_record import RequestError, RequestRecord, check_prompt
from .runner import DevicePools, ModelRunner
from .sampler import Sampler
from .sampling_params import SamplingParams
from .spec import Proposer
from .spec.eagle3 import capture_points, drafter_page_bytes, load_drafter
from .spec.step import SpeculativeStep
from .step_plan import forwards_in, is_multi_step, prefill_pieces
from .stop import StopChecker
from .tokenizer import Tokenizer

__all__ = ["Engine", "RequestError", "StepError"]

logger = logging.getLogger("tokenspeed.runtime")


class StepError(RuntimeError):
    """A step failed (the cause is chained). `aborted`: the requests of its batch, which the
    engine aborted because their state on the device is unknown; the next step reports them."""

    def __init__(self, message: str, aborted: list[Hashable]) -> None:
        super().__init__(message)
        self.aborted = aborted


class Engine:
    """One rank serving requests step by step: scheduler, two-tier cache, runner and sampler.

    The engine takes the model over: it moves it to `config.device` and into eval mode in place
    (as `nn.Module.to` does; no copy is made, so a model too big for two copies still fits), and
    on CUDA runs its shared experts on a second stream. Engines on one device may share a model.

    The engine reaches its cache only through `port` (as the scheduler and the KDA state keeper
    do); the runner reads the device pools through a `DevicePools` view. `cache`, the manager
    itself, is there for tests and tools that inspect it (occupancy, integrity).
    """

    def __init__(
        self,
        model: KimiForCausalLM,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig | None = None,
        l2: HostCache | None = None,
    ):
        self.config = config = fit_config(config or EngineConfig(), model)
        self.device = resolve_device(config.device)
        self.model = model.to(self.device).eval()
        apply_cpu_threads(config, self.model, self.device)
        if self.device.type == "cuda":
            self.model.overlap_shared_experts()
        self.tokenizer = tokenizer
        # An EAGLE3 drafter's KV rows share the target's pages: the budget pays for them too.
        drafter = load_drafter(config.speculative, self.model)
        draft_bytes = drafter_page_bytes(drafter, config.page_size)
        cache_config, geometry = plan_cache(
            self.model, config, self.device, draft_page_bytes=draft_bytes
        )
        self._owns_l2 = l2 is None and config.l2 == "local"
        if self._owns_l2:
            l2 = LocalHostCache(capacity_bytes=config.l2_capacity_bytes)
        self.l2 = l2
        self.cache = CacheManager(geometry, cache_config, l2=l2)
        self.port = CacheManagerPort(self.cache)
        self.keeper = KdaStateKeeper(self.port)
        sizes = config.graph_sizes
        self.scheduler = AggregatedScheduler(
            SchedulerConfig(
                page_size=config.page_size,
                prefill_token_budget=config.prefill_token_budget,
                max_prefill_requests=config.max_num_seqs,
                checkpoint_interval_pages=config.checkpoint_interval_pages,
                decode_batch_sizes=sizes,
                max_preemptions=config.max_preemptions,
            ),
            self.port,
            save_state_on_preempt=self.keeper.save_state,
        )
        graphs = None
        if self.device.type == "cuda":
            # Eager mode runs the same padded steps without capturing them, so that the two
            # modes compute identical numbers.
            spec = config.speculative
            graphs = DecodeGraphConfig(
                sizes,
                config.max_pages_per_request,
                capture=config.enable_cuda_graph,
                verify_width=0 if spec is None else spec.num_steps + 1,
            )
        aux = capture_points(drafter, self.model)
        self.runner = ModelRunner(self.model, DevicePools(self.cache), self.device, graphs, aux)
        self.sampler = Sampler(
            seed=config.seed, device=self.device, eos_token_ids=model.config.eos_token_ids
        )
        self.metrics = EngineMetrics()
        # Speculative decoding (docs/spec.md): None without.
        self.spec = SpeculativeStep.build(self, drafter, self.cache.sizes.num_pages)
        self._records: dict[Hashable, RequestRecord] = {}
        self._eos = tuple(model.config.eos_token_ids)
        self._aborted: list[RequestRecord] = []  # aborted by the caller; reported at the next step

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        session: Hashable | None = None,
    ) -> None:
        """Queue a request. Raises RequestError (nothing queued) when it cannot be served."""
        params = params or SamplingParams()
        if request_id in self._records:
            raise RequestError(f"request id {request_id!r} is already in use")
        record = self._new_record(request_id, prompt_token_ids, params, prompt, session)
        # Nothing is kept of a request that cannot be queued.
        self.sampler.register(request_id, params, record.prompt_ids)
        try:
            self.scheduler.add(record.sched)
        except BaseException:
            self.sampler.forget(request_id)
            raise
        self._records[request_id] = record

    def _new_record(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prompt: str | None,
        session: Hashable | None,
    ) -> RequestRecord:
        """A request's record and its scheduler request, its prompt checked (RequestError);
        nothing registered anywhere yet."""
        limit = self.config.max_model_len
        ids = check_prompt(
            request_id,
            prompt_token_ids,
            params,
            vocab_size=self.model.config.vocab_size,
            max_model_len=limit,
            has_tokenizer=self.tokenizer is not None,
        )
        chain = KeyChain(self.config.page_size)
        chain.append_tokens(ids)
        max_new = min(params.max_tokens, limit - len(ids))
        sched = Request(request_id, len(ids), max_new, keys=chain.keys, session=session)
        return RequestRecord(
            rid=request_id,
            prompt=prompt,
            prompt_ids=ids,
            params=params,
            sched=sched,
            chain=chain,
            stop=StopChecker(params, self.tokenizer, self._eos),
            metrics=RequestMetrics(arrival_time=time.monotonic()),
        )

    def abort(self, request_id: Hashable, reason: str = "aborted by the caller") -> bool:
        """Stop a request and free its cache. Returns False for an unknown or finished one."""
        record = self._records.get(request_id)
        if record is None or record.finish_reason is not None:
            return False
        self.scheduler.abort(request_id, reason)
        record.finish("abort", abort_reason=reason)
        self._aborted.append(record)
        return True

    def has_unfinished(self) -> bool:
        """Whether `step()` has anything to do or report: a request still running, or an abort
        whose final output the next step delivers (so `while engine.has_unfinished(): step()`
        sees every request end, aborted ones included)."""
        return bool(self._aborted) or any(r.finish_reason is None for r in self._records.values())

    @property
    def num_unfinished(self) -> int:
        """Requests still running (an abort waiting to be reported is not one of them)."""
        return sum(r.finish_reason is None for r in self._records.values())

    @property
    def proposer(self) -> Proposer | None:
        """The speculative step's per-request proposer (None without one); a test or tool may
        put its own in (any `tokenspeed.runtime.spec.Proposer`) before adding requests."""
        return None if self.spec is None else self.spec.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        self.spec.proposer = proposer

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; returns outputs of the requests that moved.

        If the step fails (the forward raises: out of memory, a device error), the requests of
        its batch are aborted, their state on the device being unknown, and the next step reports
        them (finish_reason "abort", the error in abort_reason); the other requests go on as if
        nothing happened. The step raises `StepError`, naming the aborted requests (an interrupt,
        such as KeyboardInterrupt, aborts the batch the same way and is raised as it is)."""
        return self.run_plan(self.plan_step())

    def plan_step(self) -> StepPlan:
        """The first half of `step`: the scheduler's plan of the next step (pages reserved).
        Every plan taken must be run, by `run_plan`, before the next one is taken."""
        return self.scheduler.schedule(max_decode_steps=self.config.decode_steps)

    def forwards_in(self, plan: StepPlan) -> int:
        """How many model forwards `run_plan(plan)` issues: one per round of prefill pieces, then
        one decode forward, or `plan.decode.steps` of them in a multi-step run (0: an empty
        plan). Ranks whose forwards are coupled (`LockstepEngine`) agree on this number."""
        return forwards_in(plan)

    def run_plan(self, plan: StepPlan) -> list[RequestOutput]:
        """The second half of `step`: run `plan` (from `plan_step`); as `step` does."""
        moved: dict[Hashable, RequestRecord] = {r.rid: r for r in self._aborted}
        self._aborted.clear()
        try:
            return self._step(plan, moved)
        except BaseException as exc:
            aborted = self._abort_batch(plan, moved, f"step failed: {exc!r}")
            if not isinstance(exc, Exception):
                raise  # an interrupt stays one; the batch is aborted all the same
            raise StepError(
                f"step failed ({exc!r}); {len(aborted)} requests of its batch aborted", aborted
            ) from exc

    def idle_forward(self) -> None:
        """One model forward over no requests, which changes nothing: what a rank with nothing
        to do runs so that its forward's collectives (DEP all-to-alls) meet its peers'."""
        self.runner.empty_forward()

    def _step(self, plan, moved: dict[Hashable, RequestRecord]) -> list[RequestOutput]:
        finished: set[Hashable] = set()
        self.keeper.clear_stash()
        start = time.monotonic()
        steps = 1
        if plan.prefill is not None:
            self._run_prefill(plan.prefill, moved, finished)
        completed = False  # the decode rows already reported to the scheduler
        if is_multi_step(plan):
            steps = self._run_decode_steps(plan, moved)  # reports each step to the scheduler
        elif plan.decode is not None:
            completed = self._run_decode(plan.decode, moved, finished)
        if not plan.empty:
            if completed and plan.prefill is not None:
                self.scheduler.complete(
                    StepPlan(prefill=plan.prefill, decode=None),
                    finished=finished,
                    save_state=self.keeper.save_state,
                )
            elif steps == 1 and not completed:
                self.scheduler.complete(plan, finished=finished, save_state=self.keeper.save_state)
            self.metrics.record_step(plan, time.monotonic() - start, steps)
        for req in self.scheduler.take_preempted():
            record = self._records.get(req.rid)
            if record is None or record.sched is not req or record.finish_reason is not None:
                # Preempted in a step that then failed, and aborted before this one took it:
                # queued again, it would be a request the engine no longer knows.
                continue
            record.metrics.preemptions += 1
            self.scheduler.add(req)
        for req in self.scheduler.take_aborted():
            record = self._records[req.rid]
            if record.finish_reason is None:
                record.finish("abort", abort_reason=req.abort_reason)
                moved[req.rid] = record
        for record in list(moved.values()):
            if record.finish_reason is None and record.sched.done:
                record.finish("length")
        self.metrics.queue_depth = len(self.scheduler.prefill.waiting)
        outputs = [self._output(r) for r in moved.values()]
        for record in moved.values():
            if record.finish_reason is not None:
                if self._records.pop(record.rid, None) is not None and (
                    record.finish_reason != "abort"
                ):
                    # Interactivity is scored per finished request (as the simulator does).
                    m = record.metrics
                    self.metrics.record_finished(
                        m.first_token_time, m.last_token_time, len(record.output_ids)
                    )
                self.keeper.forget(record.rid)
                self.sampler.forget(record.rid)
                if self.spec is not None:
                    self.spec.forget(record.rid)
        return outputs

    def _abort_batch(
        self, plan, moved: dict[Hashable, RequestRecord], reason: str
    ) -> list[Hashable]:
        """After a failed step: abort the requests of its batch that the scheduler still holds,
        and leave everything the step would have reported (those aborts, the aborts it was to
        deliver, requests that moved or ended before the failure) for the next step."""
        batch = [c.request for c in plan.prefill.chunks] if plan.prefill is not None else []
        batch += list(plan.decode.requests) if plan.decode is not None else []
        aborted = []
        for req in batch:
            record = self._records.get(req.rid)
            if record is None or req.done:
                continue  # ended (and released) before the failure: its output still comes
            self.scheduler.abort(req.rid, reason)
            record.finish("abort", abort_reason=reason)
            moved[req.rid] = record
            aborted.append(req.rid)
        self.keeper.clear_stash()
        pending = {r.rid for r in self._aborted}
        self._aborted.extend(r for r in moved.values() if r.rid not in pending)
        return aborted

    def _run_prefill(self, batch, moved, finished) -> None:
        chunks = list(batch.chunks)
        now = time.monotonic()
        pieces = prefill_pieces(batch)
        for chunk in chunks:
            record = self._records[chunk.request.rid]
            if record.metrics.first_scheduled_time is None:
                record.metrics.first_scheduled_time = now
                record.metrics.cached_tokens = chunk.request.num_cached
                self.metrics.record_admission(len(record.prompt_ids), chunk.request.num_cached)
        for round_ in range(max(len(p) for p in pieces)):
            rows = [i for i, p in enumerate(pieces) if round_ < len(p)]
            handles = [self.port.handle(chunks[i].request.rid) for i in rows]
            tokens, prefixes, sample_rows = [], [], []
            for j, i in enumerate(rows):
                lo, hi = pieces[i][round_]
                tokens.append(self._records[chunks[i].request.rid].tokens[lo:hi])
                prefixes.append(lo)
                if round_ == len(pieces[i]) - 1 and chunks[i].is_last:
                    sample_rows.append(j)
            logits = self.runner.forward(tokens, prefixes, handles, logits_rows=sample_rows)
            if self.spec is not None:  # an EAGLE3 drafter reads the target's states
                rids = [chunks[i].request.rid for i in rows]
                self.spec.prefilled(rids, prefixes, [len(t) for t in tokens])
            for i in rows:
                if round_ < len(pieces[i]) - 1:  # ended at an interior checkpoint
                    self.keeper.stash(chunks[i].request.rid, pieces[i][round_][1])
            if sample_rows:
                records = [self._records[chunks[rows[j]].request.rid] for j in sample_rows]
                self._sample(records, logits, moved, finished)

    def _run_decode(self, batch, moved, finished) -> bool:
        """One decode step of `batch`; returns whether it reported the rows to the scheduler
        itself (a speculative step, which completes its rows token by token)."""
        records = [self._records[r.rid] for r in batch.requests]
        if self.spec is not None and self.spec.run(batch, records, moved):
            return True
        handles = [self.port.handle(r.rid) for r in batch.requests]
        prefixes = [r.sched.num_computed for r in records]
        tokens = [r.tokens[n] for r, n in zip(records, prefixes, strict=True)]
        logits = self.runner.decode(tokens, prefixes, handles)
        # A row whose history now ends on a page boundary keeps its KDA state there: the turn's
        # end will be checkpointed at its last full page.
        self.keeper.decoded([r.rid for r in records], prefixes)
        self._sample(records, logits, moved, finished)
        return False

    def _run_decode_steps(self, plan, moved) -> int:
        """Multi-step decoding: the batch's `steps` decode steps back to back, each fed the
        previous step's samples on the device, then one wait for all their tokens, reported to
        the scheduler step by step as if they had run one at a time. Returns the steps run.

        A row that stops (a stop token or string) at step j still computes the later steps of
        the run; their tokens are dropped, and they write only past the row's end (its pages
        beyond the last token and its live state), which nobody reads after it is released."""
        batch = plan.decode
        records = [self._records[r.rid] for r in batch.requests]
        handles = [self.port.handle(r.rid) for r in batch.requests]
        params, rids = [r.params for r in records], [r.rid for r in records]
        base = [r.sched.num_computed for r in records]
        tokens: list[int] | torch.Tensor = [r.tokens[n] for r, n in zip(records, base, strict=True)]
        samples, crossings = [], []
        last = [r.metrics.last_token_time for r in records]
        counts = [len(r.output_ids) for r in records]
        for j in range(batch.steps):
            prefixes = [n + j for n in base]
            logits = self.runner.decode(tokens, prefixes, handles)
            # A row whose history now ends on a page boundary: its state there is copied now;
            # the checkpoint is taken once the page's tokens (sampled in this run) are known.
            crossings.append(self.keeper.crossings(rids, prefixes))
            samples.append(self.sampler.sample(logits, params, rids))
            tokens = samples[-1].tokens
        sampled = torch.stack([out.tokens for out in samples]).tolist()  # the one wait
        alive = list(range(len(records)))
        for j, out in enumerate(samples):
            for i in alive:  # the keys of pages completed by the previous step's tokens
                self.port.sync_keys(records[i].sched)
            for i, position, state in crossings[j]:
                if records[i].finish_reason is None:
                    self.keeper.keep_boundary(rids[i], position, state)
            finished: set[Hashable] = set()
            rows = [records[i] for i in alive]
            self._accept(
                rows, [sampled[j][i] for i in alive], out, alive, moved, finished, itl=False
            )
            self.scheduler.complete(
                plan, finished=finished, save_state=self.keeper.save_state, live_state=False
            )
            alive = [i for i in alive if records[i].finish_reason is None]
        for record, prev, n in zip(records, last, counts, strict=True):
            m = record.metrics
            self.metrics.record_run_itls(
                prev, m.first_token_time, m.last_token_time, len(record.output_ids) - n
            )
        return batch.steps

    def _sample(self, records: list[RequestRecord], logits: torch.Tensor, moved, finished) -> None:
        out = self.sampler.sample(logits, [r.params for r in records], [r.rid for r in records])
        rows = range(len(records))
        self._accept(records, out.tokens.tolist(), out, rows, moved, finished)

    def _accept(self, records, tokens, out, rows, moved, finished, itl: bool = True) -> None:
        """Host bookkeeping of sampled tokens: records[k] gets tokens[k], whose logprobs are row
        rows[k] of `out`; stops and length limits end requests (added to `finished`). itl=False:
        the caller records the inter-token latencies (a multi-step run)."""
        now = time.monotonic()
        for record, token, i in zip(records, tokens, rows, strict=True):
            record.append(token)
            if out.logprobs is not None and record.params.logprobs is not None:
                record.logprobs.append(float(out.logprobs[i]))
                record.top_logprobs.append(out.top_logprobs[i])
            m = record.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                self.metrics.record_ttft(now - m.arrival_time)
            elif itl:
                self.metrics.record_itl(now - m.last_token_time)
            m.last_token_time = now
            moved[record.rid] = record
            try:
                reason = record.stop.check(record.output_ids)
            except Exception as exc:
                self._abort_on_tokenizer_error(record, "checking stop strings", exc)
                finished.add(record.rid)
                continue
            if reason is not None:
                record.stop_reason = reason
                record.finish_reason = "stop"
                finished.add(record.rid)
            elif len(record.output_ids) >= record.sched.max_new_tokens:
                record.finish_reason = "length"

    def _abort_on_tokenizer_error(self, record: RequestRecord, doing: str, exc: Exception) -> None:
        """End `record` aborted because the tokenizer failed on its tokens; a running request
        also leaves the scheduler (a finishing one is released by the step as it is)."""
        reason = f"tokenizer failed {doing}: {exc!r}"
        logger.error("request %r: %s", record.rid, reason, exc_info=exc)
        if record.finish_reason is None and not record.sched.done:
            self.scheduler.abort(record.rid, reason)
        record.finish("abort", abort_reason=reason)

    def _output(self, record: RequestRecord) -> RequestOutput:
        try:
            text = record.stop.text(record.output_ids) if self.tokenizer is not None else ""
        except Exception as exc:
            # A tokenizer that cannot render these tokens costs this request, not the engine:
            # raising here would fail every later step too, as they report it again.
            text = ""
            self._abort_on_tokenizer_error(record, "rendering its text", exc)
        return record.output(text)

    def reset_metrics(self) -> EngineMetrics:
        """Start the engine-wide counters afresh (e.g. after a warm-up that compiled kernels);
        returns the counters so far. Requests still running keep their own metrics."""
        old, self.metrics = self.metrics, EngineMetrics()
        self.metrics.queue_depth = old.queue_depth
        return old

    def load(self) -> LoadSnapshot:
        """Requests running and queued, outstanding tokens, device pages (runtime/load.py)."""
        return engine_load(self)

    def check_integrity(self) -> None:
        self.port.check_integrity()

    def close(self) -> None:
        self.port.close()
        if self._owns_l2:
            self.l2.close()
