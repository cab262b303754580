"""`MultiRankEngine`: one engine over several worker processes (attention-DP ranks, experts
split over them: DEP in lockstep, or DWDP prefill ranks stepping independently; or TEP, every
rank running every request), driven from the user's process.

    engine = MultiRankEngine("tiny", ParallelConfig(world_size=2), EngineConfig(device="cpu"))
    engine.add_request("a", prompt_token_ids, SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():     # outputs that arrived from any rank
            ...
    engine.close()

It spawns `world_size` worker processes (runtime/worker.py; multiprocessing's spawn context,
so a script using it needs the usual `if __name__ == "__main__":` guard) and owns them: `close()`,
a worker failure and interpreter exit stop every one of them by PID. Each rank keeps its own
scheduler and cache; the front end places every request on one rank, the one with the least
outstanding work (tokens still to compute of its unfinished requests, by the router of
tokenspeed.sched.router) unless the caller names the rank (`add_request(..., rank=r)`). DEP
ranks step together (`LockstepEngine`); DWDP ranks (`ParallelConfig.dwdp`) each step alone.

Replica groups: the unit of placement is a group of consecutive ranks that run the same
requests: a DCP group of `dcp` ranks (`ParallelConfig.dcp`: decode context parallelism, each
member keeping its share of the request's MLA rows), or the TEP group of every rank
(`ParallelConfig.tep`: each rank its heads and its slice of every expert). A request placed on
a group is sent to every member (they apply it at the same step, agreed in the lockstep
all-reduce); the group's first rank (its leader) alone reports outputs, rejections and cache
counters, and the load report has one entry per group (`rank`: its leader).

Host tier: with `ParallelConfig.l2="mooncake"` every rank reads and writes one Mooncake store,
so a turn placed on another rank than its conversation's earlier turns still loads their
prefix. Without `l2_master`, the front end starts the store (a master and a segment owner on
loopback free ports, `tokenspeed.cache.l2.mooncake_services`) before the workers and stops
both after them (close, failure, interpreter exit; they also die with this process).

Faults: a worker that dies, or whose step fails, makes the next `step()` (or any later call)
raise `WorkerError` naming the rank and the cause, after every other worker was stopped.
Workers exit by themselves when the front end's process is gone (their pipe closes).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import socket
import time
import types
import weakref
from collections.abc import Hashable, Sequence
from multiprocessing.connection import wait

import attrs
import torch

from tokenspeed.model import PRESETS
from tokenspeed.model.hf_config import load_config_json
from tokenspeed.model.loader import resolve_dtype
from tokenspeed.sched.config import RouterConfig, RoutingPolicy
from tokenspeed.sched.router import Router

from .cache_sizing import check_budget_fits, fit_config, plan_cache
from .config import EngineConfig, EngineConfigError
from .device import resolve_device
from .engine import RequestError
from .llm import _DTYPES
from .outputs import RequestOutput
from .parallel_config import ParallelConfig, ParallelError, model_config_of
from .request_record import check_prompt
from .sampling_params import SamplingParams
from .tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from .worker import WorkerSpec, worker_main

__all__ = ["LoadReport", "MultiRankEngine", "RankLoad", "WorkerError"]

# How long step() waits for outputs when requests are outstanding and none has arrived.
STEP_WAIT_S = 0.05
# After a first sign of failure, how long to wait for the other workers' reports (to name the
# rank that failed first rather than a peer whose collective then failed).
SETTLE_S = 1.0


class WorkerError(RuntimeError):
    """A worker process died or its step failed; every worker has been stopped.
    rank: the rank that failed first; cause: what happened to it."""

    def __init__(self, rank: int, cause: str, details: str = "") -> None:
        message = f"worker rank {rank} failed: {cause}; every worker has been stopped"
        super().__init__(message + (f"\n{details}" if details else ""))
        self.rank = rank
        self.cause = cause


@attrs.define
class RankLoad:
    """What the front end placed on one rank (tokens: prompt + most new tokens)."""

    rank: int
    pid: int | None
    requests: int = 0
    tokens: int = 0
    finished: int = 0
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    # The rank's prefix cache (as of its latest outputs): prompt tokens presented to it, of
    # them hit, of those loaded from the host tier (L2), and objects it published to L2.
    cache_prompt_tokens: int = 0
    cache_hit_tokens: int = 0
    l2_hit_tokens: int = 0
    l2_published: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cache_hit_tokens / self.cache_prompt_tokens if self.cache_prompt_tokens else 0.0


@attrs.frozen
class LoadReport:
    ranks: tuple[RankLoad, ...]

    @property
    def l2_hit_tokens(self) -> int:
        """Prompt tokens every rank loaded from the host tier (the shared one: other ranks')."""
        return sum(r.l2_hit_tokens for r in self.ranks)

    @property
    def request_imbalance(self) -> float:
        """max / mean of the requests placed per rank (1.0: perfectly even, or none)."""
        return _imbalance([r.requests for r in self.ranks])

    @property
    def token_imbalance(self) -> float:
        """max / mean of the tokens placed per rank."""
        return _imbalance([r.tokens for r in self.ranks])

    def as_dict(self) -> dict:
        return {
            "ranks": [attrs.asdict(r) for r in self.ranks],
            "request_imbalance": self.request_imbalance,
            "token_imbalance": self.token_imbalance,
            "l2_hit_tokens": self.l2_hit_tokens,
        }


def _imbalance(values: Sequence[int]) -> float:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else 1.0


@attrs.define
class _Placed:
    """A request on its rank, and the work it still has."""

    rank: int
    prompt_len: int
    max_new: int
    generated: int = 0

    @property
    def outstanding(self) -> int:
        return (0 if self.generated else self.prompt_len) + self.max_new - self.generated


def free_port() -> int:
    """A TCP port free now on the loopback interface (for the workers' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def front_tokenizer(model: str, config) -> Tokenizer | None:
    """The tokenizer the workers build, for the front end (a preset's bytes, a checkpoint's)."""
    if model in PRESETS:
        return ByteTokenizer(config.vocab_size, eos_token_ids=config.eos_token_ids)
    return load_tokenizer(model, config.eos_token_ids)


def model_dtype(model: str, dtype: str, device: torch.device) -> torch.dtype:
    """The dtype the workers build the model in (as `load_model` / the loader resolve it)."""
    if model in PRESETS:
        if dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
        return _DTYPES[dtype]
    return resolve_dtype(dtype, load_config_json(model))


def check_rank_cache(
    model, model_config, config, dtype, device, world_size: int, dcp: int = 1
) -> None:
    """Refuse, before any worker starts, a cache every rank would refuse (a budget that cannot
    hold one request, more than the device holds); ranks sharing the host's memory (the CPU)
    need world_size caches of it. model_config: a rank's (`ParallelConfig.rank_model_config`:
    a TEP rank's heads); dcp: ranks splitting the MLA rows (pages of fewer bytes)."""
    head = types.SimpleNamespace(weight=torch.empty(0, dtype=model_dtype(model, dtype, device)))
    stub = types.SimpleNamespace(config=model_config, lm_head=head)
    cache_config, _ = plan_cache(stub, config, device, dcp=dcp)
    if device.type == "cpu" and world_size > 1:
        budget = cache_config.device_budget_bytes
        try:
            check_budget_fits(
                budget * world_size, device, explicit=config.cache_budget_bytes is not None
            )
        except EngineConfigError as exc:
            where = f"{world_size} ranks on this host, {budget} bytes of cache each"
            raise type(exc)(f"{where}: {exc}") from None


def _check_tep_experts(model: str, parallel: ParallelConfig) -> None:
    """Refuse TEP over a checkpoint whose routed experts are MXFP4: `apply_tp` slices dense
    experts only (it would fail in every worker after the model was built)."""
    if model in PRESETS:
        return
    from tokenspeed.model.loader import expert_format_of

    if expert_format_of(load_config_json(model)) == "mxfp4":
        raise ParallelError(
            f"ParallelConfig.tep={parallel.tep} slices every expert's intermediate columns, but "
            f"{model} stores its routed experts in MXFP4 (apply_tp shards dense experts only): "
            "use DEP (ep) for this checkpoint"
        )


def _stop_processes(procs, commands, results, grace_s: float, services=()) -> None:
    """Stop worker processes by PID: ask, wait up to grace_s, terminate, then kill; then the
    Mooncake services the engine started (killed and reaped by PID). Idempotent (also the
    finalizer run at interpreter exit: it holds no reference to the engine)."""
    for conn in commands:
        with contextlib.suppress(Exception):
            conn.send(("shutdown",))
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.join(max(0.0, deadline - time.monotonic()))
    for sig in ("terminate", "kill"):
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        for proc in alive:
            with contextlib.suppress(Exception):
                getattr(proc, sig)()
        deadline = time.monotonic() + grace_s
        for proc in alive:
            with contextlib.suppress(Exception):
                proc.join(max(0.0, deadline - time.monotonic()))
    for conn in (*commands, *results):
        with contextlib.suppress(Exception):
            conn.close()
    for service in reversed(services):  # the segment owner, then the master
        with contextlib.suppress(Exception):
            service.stop(timeout=grace_s)


def _exit_cause(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the process was killed by {name}"
    return f"the process exited with code {exitcode}"


class MultiRankEngine:
    """The front end of `world_size` engine ranks in worker processes (see the module doc).

    model: a preset name or a checkpoint directory; parallel: the layout; config: every rank's
    `EngineConfig` (its device: "cpu", or CUDA, one GPU per rank); dtype, seed: as for `LLM`.
    Bad layouts (against each other, the model, the machine) and bad engine configs are refused
    before any process starts. Every worker is built when the constructor returns (or the
    constructor raised `WorkerError` after stopping them all)."""

    def __init__(
        self,
        model: str,
        parallel: ParallelConfig,
        config: EngineConfig | None = None,
        *,
        dtype: str = "auto",
        seed: int = 0,
        routing: RoutingPolicy | str = RoutingPolicy.LEAST_WORK,
    ) -> None:
        if not isinstance(parallel, ParallelConfig):
            raise ParallelError(f"parallel must be a ParallelConfig, got {parallel!r}")
        config = config or EngineConfig()
        model = str(model)
        # Everything that can be checked is checked before a process starts.
        model_config = model_config_of(model)
        parallel.check_model(model_config)
        parallel.check_engine(config)
        if parallel.l2_backend == "mooncake" and config.l2 == "none":
            raise ParallelError(
                "ParallelConfig.l2='mooncake' shares a host tier, but EngineConfig.l2='none' "
                "turns it off: give one"
            )
        parallel.check_environment()
        if parallel.tep > 1:
            _check_tep_experts(model, parallel)
        device = resolve_device(config.device)
        if device.type == "cuda" and parallel.independent and parallel.dims().dwdp > 1:
            raise ParallelError(
                f"ParallelConfig.dwdp={parallel.dwdp} on CUDA needs a one-sided peer-copy fetch "
                "of the experts (not written yet; the shared-memory one maps CPU tensors): run "
                "DWDP ranks on the CPU, or DEP"
            )
        if device.type == "cuda" and parallel.world_size > torch.cuda.device_count():
            raise ParallelError(
                f"ParallelConfig.world_size={parallel.world_size} needs one GPU per rank, but "
                f"this machine has {torch.cuda.device_count()}"
            )
        self.config = fit_config(config, types.SimpleNamespace(config=model_config))
        # A rank's cache is sized from its own model: a TEP rank's KDA slots hold its heads.
        rank_config = parallel.rank_model_config(model_config)
        check_rank_cache(
            model, rank_config, self.config, dtype, device, parallel.world_size, parallel.dcp
        )
        self.parallel = parallel
        self.model_config = model_config
        self.tokenizer = front_tokenizer(model, model_config)
        # Requests are placed on attention-DP units: ranks, or replica groups (DCP, TEP) by
        # their leader.
        self._group = parallel.replicas
        self._router = Router(
            RouterConfig(num_prefill_ranks=parallel.attention_dp, policy=RoutingPolicy(routing))
        )
        self._placed: dict[Hashable, _Placed] = {}
        world = parallel.world_size
        self._loads = [RankLoad(rank, None) for rank in range(0, world, self._group)]
        self._pending: list[RequestOutput] = []
        # Per rank, how it holds the routed experts ("dep", "dwdp", "replicated"), once ready.
        self.rank_experts: list[str | None] = [None] * world
        # Per rank, its device cache (`worker.cache_layout`: pages, MLA rows and bytes of a
        # page, tokens held), once ready.
        self.rank_caches: list[dict | None] = [None] * world
        self._failure: WorkerError | None = None
        self._closed = False

        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        self._procs, self._commands, self._results = [], [], []
        self._services: list = []  # the Mooncake master and segment owner this engine started
        # The finalizer holds the lists (filled below), never the engine: close(), a failure
        # and interpreter exit all stop the same processes.
        self._finalizer = weakref.finalize(
            self,
            _stop_processes,
            self._procs,
            self._commands,
            self._results,
            parallel.stop_grace_s,
            self._services,
        )
        try:
            self.l2_master = self._start_l2(parallel)
            spec = WorkerSpec(
                model=model,
                dtype=dtype,
                seed=seed,
                config=config,
                parallel=parallel,
                l2_master=self.l2_master,
            )
            for rank in range(world):
                cmd_recv, cmd_send = ctx.Pipe(duplex=False)
                res_recv, res_send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main,
                    args=(spec, rank, port, cmd_recv, res_send),
                    name=f"tokenspeed-rank{rank}",
                    daemon=True,
                )
                self._commands.append(cmd_send)
                self._results.append(res_recv)
                self._procs.append(proc)
                proc.start()
                # The parent's copies of the child's ends: closing them lets EOF through.
                cmd_recv.close()
                res_send.close()
                if rank % self._group == 0:
                    self._loads[rank // self._group].pid = proc.pid
            self._wait_ready(parallel.start_timeout_s)
        except BaseException:
            self._finalizer()
            raise

    # ------------------------------------------------------------------ lifecycle
    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def service_pids(self) -> list[int]:
        """The PIDs of the Mooncake master and segment owner this engine started (none when
        it joined a given master or each rank has its own tier)."""
        return [s.pid for s in self._services]

    @property
    def mode(self) -> str:
        """The mode: "dep" (ranks in lockstep, attention data parallel), "tep" (in lockstep,
        every rank running every request) or "dwdp" (independent prefill ranks)."""
        if self.parallel.independent:
            return "dwdp"
        return "tep" if self.parallel.tep > 1 else "dep"

    def _start_l2(self, parallel: ParallelConfig) -> str | None:
        """The shared tier's master address: the given one, or a master and a segment owner
        started here (stopped with the workers); None: every rank its own tier."""
        if parallel.l2_backend != "mooncake":
            return None
        if parallel.l2_master is not None:
            return parallel.l2_master
        from tokenspeed.cache.l2.mooncake_services import start_master, start_segment_owner

        timeout = min(30.0, parallel.start_timeout_s)
        master = start_master(timeout=timeout)
        self._services.append(master)
        owner = start_segment_owner(
            master_address=master.address,
            segment_bytes=parallel.l2_segment_bytes,
            timeout=timeout,
        )
        self._services.append(owner)
        return master.address

    def _wait_ready(self, timeout_s: float) -> None:
        ready: dict[int, EngineConfig] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self._procs):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(len(self._procs))) - set(ready))
                self._fail(
                    missing[0],
                    f"ranks {missing} not ready within start_timeout_s={timeout_s} s",
                )
            self._receive(min(left, STEP_WAIT_S * 10), on_ready=ready)
        self.config = ready[0]  # as the engines resolved it (identical on every rank)

    def close(self) -> None:
        """Stop every worker (asked first, then terminated, then killed, by PID). Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> MultiRankEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError("the engine is closed")

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        prompt: str | None = None,
        session: Hashable | None = None,
        rank: int | None = None,
    ) -> int:
        """Queue a request on `rank`, or (None) on the rank with the least outstanding work;
        returns that rank. With replica groups (DCP, TEP), on the group of `rank` (or the least
        loaded group), every member of it; returns the group's leader. Raises RequestError
        (nothing queued) when it cannot be served."""
        self._check()
        world = self.parallel.world_size
        if rank is not None and (
            not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world
        ):
            raise RequestError(
                f"request {request_id!r}: rank must be None or an int in [0, {world}), got {rank!r}"
            )
        params = params or SamplingParams()
        if request_id in self._placed:
            raise RequestError(f"request id {request_id!r} is already in use")
        limit = self.config.max_model_len
        ids = check_prompt(
            request_id,
            prompt_token_ids,
            params,
            vocab_size=self.model_config.vocab_size,
            max_model_len=limit,
            has_tokenizer=self.tokenizer is not None,
        )
        if rank is None:
            loads = [load.outstanding_tokens for load in self._loads]
            rank = self._router.pick_prefill(loads, session) * self._group
        rank -= rank % self._group  # its replica group's leader
        placed = _Placed(rank, len(ids), min(params.max_tokens, limit - len(ids)))
        self._send(rank, ("add", request_id, ids, params, prompt, session))
        self._placed[request_id] = placed
        load = self._loads[rank // self._group]
        load.requests += 1
        load.tokens += placed.outstanding
        load.outstanding_requests += 1
        load.outstanding_tokens += placed.outstanding
        return rank

    def abort(self, request_id: Hashable, reason: str = "aborted by the caller") -> bool:
        """Stop a request; its final output (finish_reason "abort", or its end if it finished
        meanwhile) comes from a later step. False for an unknown or finished request, or when
        the engine has failed or is closed."""
        placed = self._placed.get(request_id)
        if placed is None or self._failure is not None or self._closed:
            return False
        self._send(placed.rank, ("abort", request_id, reason))
        return True

    def has_unfinished(self) -> bool:
        """Whether a request is still running or an output waits to be returned."""
        return bool(self._placed) or bool(self._pending)

    @property
    def num_unfinished(self) -> int:
        return len(self._placed)

    def _send(self, rank: int, command) -> None:
        """Send `command` to `rank`, or to every member of its replica group (`rank`: the
        leader)."""
        for member in self.parallel.replica_ranks(rank):
            try:
                self._commands[member].send(command)
            except (OSError, ValueError):
                self._fail(member, _exit_cause(self._procs[member].exitcode))

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """The outputs that arrived from the ranks since the last step, waiting briefly for
        some when requests are outstanding. Raises `WorkerError` once a worker has failed."""
        self._check()
        outputs, self._pending = self._pending, []
        if outputs:
            self._receive(0.0, outputs)
        else:
            self._receive(STEP_WAIT_S if self._placed else 0.0, outputs)
        return outputs

    def _receive(self, timeout: float, outputs=None, on_ready=None) -> None:
        """Read every message that arrived (waiting up to timeout for the first); a failed or
        dead worker stops them all and raises WorkerError."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        ready = wait([*self._results, *sentinels], timeout)
        if not ready:
            return
        rejected = None
        for rank, conn in enumerate(self._results):
            while True:
                try:
                    if not conn.poll():
                        break
                    message = conn.recv()
                except (EOFError, OSError):
                    self._fail(rank, _exit_cause(self._procs[rank].exitcode))
                kind = message[0]
                if kind == "out":
                    self._arrived(rank, message[1], outputs)
                    self._counted(rank, message[2])
                elif kind == "ready":
                    config = message[3]
                    if on_ready is None:
                        continue
                    on_ready[rank] = config
                    self.rank_experts[rank] = message[4]
                    self.rank_caches[rank] = message[5]
                elif kind == "rejected":
                    _, rid, detail = message
                    self._forget(rid)
                    rejected = rejected or RequestError(detail)
                elif kind == "error":
                    _, _, cause, detail = message
                    self._fail(rank, cause, detail)
        for sentinel in ready:
            if sentinel in sentinels:
                rank = sentinels[sentinel]
                self._fail(rank, _exit_cause(self._procs[rank].exitcode))
        if rejected is not None:
            self._pending.extend(outputs or ())
            if outputs is not None:
                outputs.clear()
            raise rejected

    def _arrived(self, rank: int, outs: list[RequestOutput], outputs) -> None:
        for out in outs:
            placed = self._placed.get(out.request_id)
            if placed is None:
                continue  # rejected, or finished already
            load = self._loads[rank // self._group]
            before = placed.outstanding
            placed.generated = len(out.outputs[0].token_ids)
            load.outstanding_tokens -= before - placed.outstanding
            if out.finished:
                self._forget(out.request_id)
                load.finished += 1
            if outputs is not None:
                outputs.append(out)

    def _counted(self, rank: int, counts: dict[str, int]) -> None:
        load = self._loads[rank // self._group]
        load.cache_prompt_tokens = counts["prompt_tokens"]
        load.cache_hit_tokens = counts["hit_tokens"]
        load.l2_hit_tokens = counts["l2_hit_tokens"]
        load.l2_published = counts["objects_published"]

    def _forget(self, rid) -> None:
        placed = self._placed.pop(rid, None)
        if placed is not None:
            load = self._loads[placed.rank // self._group]
            load.outstanding_requests -= 1
            load.outstanding_tokens -= placed.outstanding

    def _fail(self, rank: int, cause: str, details: str = ""):
        """Name the rank that failed first, stop every worker, and raise WorkerError."""
        if self._failure is not None:
            raise self._failure
        # Peers of a dead rank fail in their collectives right after it: give the reports a
        # moment, and blame a rank that died without a word (killed) before one that reported.
        reports = {rank: (cause, details)} if details else {}
        dead = {}
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            for r, conn in enumerate(self._results):
                with contextlib.suppress(Exception):
                    while conn.poll():
                        message = conn.recv()
                        if message[0] == "error":
                            reports.setdefault(r, (message[2], message[3]))
            dead = {r: p.exitcode for r, p in enumerate(self._procs) if p.exitcode not in (None, 0)}
            silent = [r for r in dead if r not in reports]
            if silent:
                break
            time.sleep(0.05)
        silent = sorted(r for r in dead if r not in reports)
        if silent:
            rank, cause, details = silent[0], _exit_cause(dead[silent[0]]), ""
        elif rank not in reports and reports:
            rank = min(reports)
            cause, details = reports[rank]
        others = "\n".join(f"rank {r}: {c}" for r, (c, _) in sorted(reports.items()) if r != rank)
        self._finalizer()
        self._failure = WorkerError(rank, cause, "\n".join(x for x in (details, others) if x))
        raise self._failure

    # ------------------------------------------------------------------ metrics
    def load_report(self) -> LoadReport:
        """Per-rank load placed by the front end, and its imbalance (max / mean); with replica
        groups (DCP, TEP), per group (counted once, `rank` its leader)."""
        return LoadReport(tuple(attrs.evolve(load) for load in self._loads))

    def metrics(self) -> dict:
        """load_report() as a dict: per-rank requests and tokens placed, finished, outstanding,
        prefix-cache and L2 hits, and the request and token imbalance (max / mean over ranks)."""
        return self.load_report().as_dict()
