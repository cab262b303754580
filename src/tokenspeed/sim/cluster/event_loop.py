"""The discrete-event core shared by both cluster modes: clock, event queue, sessions, records.

Events are (time, sequence, handler, argument) in a heap; the sequence number breaks ties in
insertion order, so a run is a pure function of its inputs. The load is closed-loop: `concurrency`
sessions are in flight; each issues its next turn `delay_s` after the previous answer (and after
its subagents, if the turn launched any); a finished session is replaced by the next one from the
source. Timed workloads (Mooncake traces) start each session at its recorded time instead. No turn
is issued at or after `duration_s`; everything in flight drains.

Subclasses (P/D, aggregated) build their ranks over `host_tiers`, implement `_admit_request`,
and call `_finished` / `_aborted` / `_preempted` as requests leave the cluster.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

from tokenspeed.sched import Request
from tokenspeed.sched.batch import DecodeBatch
from tokenspeed.sim.cluster.config import ClusterConfig
from tokenspeed.sim.cluster.ranks import AggregatedRank, PrefillRank, build_host_tiers
from tokenspeed.sim.cluster.records import RequestRecord
from tokenspeed.sim.cluster.sessions import Conversation, PrefixChains
from tokenspeed.sim.cost import CostModel, decode_run_ends
from tokenspeed.workload import Session, SessionSource


class LostRequestError(AssertionError):
    """A simulation ended with a request neither finished nor aborted with a reason."""


def check_load(config: ClusterConfig, workload: SessionSource) -> None:
    """Raise ValueError if the run would never end: `duration_s=None` (run the workload to its
    end) needs a finite workload, one with a `len()` such as a loaded trace."""
    if config.duration_s is None and not isinstance(workload, Sized):
        name = getattr(workload, "name", type(workload).__name__)
        raise ValueError(
            f"duration_s=None runs the workload to its end, but {name} is endless; give a duration"
        )


class EventLoop:
    def __init__(
        self,
        config: ClusterConfig,
        workload: SessionSource,
        cost: CostModel,
        *,
        progress: bool = False,
    ) -> None:
        check_load(config, workload)
        self.config = config
        self.workload = workload
        self.cost = cost
        self.progress = progress
        self.now = 0.0
        self.events = 0
        self.records: dict[Any, RequestRecord] = {}
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self._rids = itertools.count()
        self._fresh_ids = itertools.count(1)
        self._conversations: dict[Any, Conversation] = {}  # rid -> conversation of that turn
        self._requests: dict[Any, Request] = {}  # rid -> request, while in the cluster
        self._sessions: Iterator[Session] = iter(workload)
        self._prefixes = PrefixChains(config.geometry.page_size, workload.block_size)
        self._open_sessions = 0
        self.wall_s = 0.0
        self.cpu_s = 0.0
        # Decode (or verify) steps run, summed over their rows: per request, how many steps its
        # output took (a speculative cost model emits several tokens per step).
        self.decode_row_steps = 0
        self.host_tiers = build_host_tiers(config)  # one entry per rank, prefill ranks first
        g = config.geometry
        self._bytes_per_token = g.mla_page_bytes / g.page_size
        self._state_bytes = g.kda_state_bytes

    # ---- events -------------------------------------------------------------------------------
    def at(self, when: float, handler: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), handler, arg))

    def cut_run(self, rank, done: Callable[[Any], None]) -> None:
        """Something must join `rank`'s run of decode steps: end the run after the step now in
        flight. The run's completion event is superseded (its epoch is stale) by one at that
        step's end, which calls `done((rank, epoch))`."""
        j = bisect.bisect_left(rank.ends, self.now - rank.start)
        last_of_step = getattr(rank.ends, "last_of_step", None)
        if last_of_step is not None and j < rank.steps:
            j = last_of_step(j)  # speculative: the verify step in flight emits all its tokens
        if j + 1 >= rank.steps:
            return
        rank.steps = j + 1
        rank.epoch += 1
        self.at(rank.start + rank.ends[j], done, (rank, rank.epoch))

    def run(self) -> None:
        started, cpu_started = time.perf_counter(), time.process_time()
        self._start_load()
        heap, pop = self._heap, heapq.heappop
        bar = self._progress_bar()
        while heap:
            when, _, handler, arg = pop(heap)
            self.now = when
            handler(arg)
            self.events += 1
            if bar is not None and self.events % 1000 == 0:
                self._show_progress(bar)
        if bar is not None:
            self._show_progress(bar)
            bar.close()
        self.wall_s = time.perf_counter() - started
        self.cpu_s = time.process_time() - cpu_started
        self._check_nothing_lost()

    def _progress_bar(self):
        if not self.progress:
            return None
        from tqdm import tqdm

        if self.config.duration_s is None:  # the whole workload: its end is not known up front
            bar_format = "{desc} {n:.0f} sim-s [{elapsed}]{postfix}"
        else:
            bar_format = (
                "{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} sim-s "
                "[{elapsed}<{remaining}]{postfix}"
            )
        return tqdm(
            total=self.config.duration_s,
            desc=f"c={self.config.concurrency}",
            dynamic_ncols=True,
            bar_format=bar_format,
        )

    def _show_progress(self, bar) -> None:
        """Simulated time up to the end of the load; then the drain, as requests in flight."""
        draining = bar.total is not None and self.now >= bar.total
        bar.n = self.now if bar.total is None else min(self.now, bar.total)
        phase = "draining, " if draining else ""
        bar.set_postfix_str(f"{phase}{len(self._requests)} in flight, {len(self.records)} issued")

    # ---- load generation ----------------------------------------------------------------------
    def _open(self) -> bool:
        """Whether new turns may still be issued."""
        return self.config.duration_s is None or self.now < self.config.duration_s

    def _start_load(self) -> None:
        if getattr(self.workload, "timed", False):
            for session in self._sessions:
                if session.start_s is None:  # it would never start
                    raise ValueError(f"session {session.sid} of a timed workload has no start_s")
                if self.config.duration_s is None or session.start_s < self.config.duration_s:
                    self._open_sessions += 1
                    self.at(session.start_s, self._issue_turn, Conversation(session))
            return
        for _ in range(self.config.concurrency):
            if not self._start_next_session():
                break

    def _start_next_session(self) -> bool:
        if not self._open():
            return False
        session = next(self._sessions, None)
        if session is None:
            return False
        self._open_sessions += 1
        self.at(self.now, self._issue_turn, Conversation(session))
        return True

    def _issue_turn(self, conv: Conversation) -> None:
        if not self._open():
            self._conversation_done(conv)
            return
        rid = next(self._rids)
        req = conv.next_request(rid, self._prefixes, self._fresh_ids)
        self._conversations[rid] = conv
        self._requests[rid] = req
        self.records[rid] = RequestRecord(
            rid=rid,
            session=conv.session.sid,
            kind=conv.session.kind,
            arrival=self.now,
            prompt_tokens=req.prompt_len,
            output_tokens=req.max_new_tokens,
        )
        self._admit_request(req)

    def _turn_done(self, conv: Conversation) -> None:
        subagents = conv.turn.subagents
        if subagents and self._open():
            conv.subagents_left = len(subagents)
            for sub in subagents:
                self.at(self.now, self._issue_turn, Conversation(sub, conv))
            return
        self._next_turn(conv)

    def _next_turn(self, conv: Conversation) -> None:
        conv.index += 1
        if conv.index < len(conv.session.turns):
            self.at(self.now + conv.turn.delay_s, self._issue_turn, conv)
        else:
            self._conversation_done(conv)

    def _conversation_done(self, conv: Conversation) -> None:
        parent = conv.parent
        if parent is not None:
            parent.subagents_left -= 1
            if parent.subagents_left == 0:
                self._next_turn(parent)
            return
        self._open_sessions -= 1
        if not getattr(self.workload, "timed", False):
            self._start_next_session()

    # ---- forwards on the ranks ----------------------------------------------------------------
    def _record_admission(self, rank: PrefillRank | AggregatedRank, req: Request) -> float:
        """The first prefill chunk of `req` since it was (re)admitted on `rank`: mark it admitted,
        record it, and return the bytes its host-tier hit loads (pages, plus the KDA state when
        the hit's checkpoint comes from there)."""
        rank.admitted.add(req.rid)
        rec = self.records[req.rid]
        if rec.prefill_start is None:
            rec.prefill_start = self.now
        rec.cached_tokens += req.num_cached
        rec.prefilled_tokens += req.prefill_target
        handle = rank.port.handle(req.rid)
        load_bytes = handle.l2_cached_tokens * self._bytes_per_token
        if handle.load.l2_checkpoint:
            load_bytes += self._state_bytes
        return load_bytes

    def _decode_run_ends(self, batch: DecodeBatch) -> Sequence[float]:
        """A run of decode steps over `batch` starts now: record each row's first decode step,
        and return the cumulative end offsets of the run's steps."""
        for req in batch.requests:
            rec = self.records[req.rid]
            if rec.first_decode_step is None:
                rec.first_decode_step = self.now
        return decode_run_ends(
            self.cost, batch.size, batch.padded_size, sum(batch.history_lens), batch.steps
        )

    def _count_decode(self, rows: int, ends: Sequence[float], tokens: int) -> None:
        """A run of `tokens` decode tokens over `rows` rows completed."""
        verify_steps = getattr(ends, "verify_steps", None)
        self.decode_row_steps += rows * (tokens if verify_steps is None else verify_steps(tokens))

    # ---- requests leaving the cluster ---------------------------------------------------------
    def _admit_request(self, req: Request) -> None:
        raise NotImplementedError

    def _finished(self, req: Request) -> None:
        rec = self.records[req.rid]
        rec.finish = self.now
        rec.generated = req.num_output
        rec.preemptions = req.preemptions
        del self._requests[req.rid]
        self._turn_done(self._conversations.pop(req.rid))

    def _aborted(self, req: Request) -> None:
        """The request ended without an answer: its conversation cannot go on."""
        rec = self.records[req.rid]
        rec.finish = self.now
        rec.abort_reason = req.abort_reason or "aborted"
        rec.generated = req.num_output
        rec.preemptions = req.preemptions
        del self._requests[req.rid]
        conv = self._conversations.pop(req.rid)
        conv.index = len(conv.session.turns) - 1
        self._next_turn(conv)

    def _check_nothing_lost(self) -> None:
        """Every issued request finished or was aborted with a reason; every queue is empty."""
        lost = [
            r.rid
            for r in self.records.values()
            if r.finish is None or (not r.finished and not r.abort_reason)
        ]
        if lost or self._requests:
            raise LostRequestError(
                f"{len(lost)} requests neither finished nor aborted (e.g. {lost[:5]}); "
                f"{len(self._requests)} still held: "
                f"{[(r.rid, r.state.value) for r in list(self._requests.values())[:5]]}"
            )
        bad = [r for r in self.records.values() if r.finished and r.generated != r.output_tokens]
        if bad:
            raise LostRequestError(f"{len(bad)} finished requests got the wrong number of tokens")
        if self._open_sessions:
            raise LostRequestError(f"{self._open_sessions} sessions never ended")
