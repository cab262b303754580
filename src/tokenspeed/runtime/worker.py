"""One rank of a multi-rank engine: its model share, its engine and its step loop.

Spawned by `MultiRankEngine` (runtime/multirank.py), a worker joins the process group, builds
its groups and its share of the model (a preset: seeded random weights, then `parallelize`, or
for a preset whose fp32 weights exceed PER_RANK_INIT_BYTES, Kimi-Linear-48B shapes, a meta
model, `parallelize`, then `init_rank_random_weights`, drawing only its share on its device; a
checkpoint directory: a meta model, `parallelize`, then `load_rank_checkpoint`, so it reads
only its share), an `Engine` (its host tier: its own, or the shared Mooncake store at the
master address the front end passes) and then loops: drain the front end's commands (add /
abort / shutdown), step, send the outputs back (with the rank's cache counters). It exits when
told to, when its step fails (reported to the front end first) and when the front end's pipe
closes (the front end is gone).

Two modes, by `ParallelConfig.dwdp`:
- DEP (dwdp None): a `LockstepEngine` over a gloo control group spanning the world; every rank
  steps with its peers (the experts' all-to-alls couple their forwards). Replica groups: with
  `ParallelConfig.dcp`, the members of a DCP group run the same requests (each holding its
  share of their MLA rows); with `ParallelConfig.tep`, every rank runs every request (its
  model split by `apply_tp`: its heads, its slice of every expert; one TEP group spanning the
  world). The front end sends every command to every member of the group, and each member
  applies them at the step its group's leader (first member) agreed in the lockstep all-reduce,
  so their schedulers see the same requests at the same steps; only the leader answers
  (outputs, rejections, cache counters).
- DWDP prefill ranks: the routed experts stored split over the dwdp group and fetched one-sided
  (`apply_dwdp(..., transport="shared_memory")`, CPU weights: each rank's block in shared
  memory, its peers copying from it); every rank steps its own engine on its own, never waiting
  for a peer. Where `apply_dwdp` has no one-sided transport (its broadcasts need every rank in
  every forward), the ranks hold the whole model (replicated) instead: the same tokens, the
  same independence, more memory.

Under torchrun, the same rank runs with its rank from the environment; rank 0 reads the prompts,
places them on the ranks by least outstanding work, and prints the outputs (one JSON line per
prompt, in prompt order):

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m tokenspeed.runtime.worker --model tiny --ep 2 \\
        --prompt-ids '[[5, 6, 7], [8, 9]]' --max-tokens 16

(--dcp N: DCP groups of N ranks, a prompt placed on a group; --tep N, N the world size: TEP,
every prompt on every rank.)

--prompt-ids takes a JSON list of token-id lists, or a path to a file holding one; --prompt
(repeatable) a text prompt. This mode serves one batch and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from datetime import timedelta
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from tokenspeed.model import PRESETS, KimiForCausalLM, from_hf_config
from tokenspeed.parallel import ParallelGroups, backend_for, load_rank_checkpoint, parallelize
from tokenspeed.parallel.groups import Group

from .config import EngineConfig
from .device import resolve_device
from .engine import Engine, RequestError
from .parallel_config import ParallelConfig
from .request_record import check_prompt
from .sampling_params import SamplingParams

# The longest a rank with nothing to do (nor any of its peers) waits for a command before its
# next idle step; the wait doubles from 1 ms up to this while the group stays idle.
IDLE_WAIT_S = 0.05
# A preset whose random weights take more than this in fp32 (drawn whole on the host, then
# split, they would need that much host memory in every worker: 192 GB at Kimi-Linear-48B
# shapes) is drawn per rank instead (`init_rank_random_weights`: each rank its share, on its
# device, from per-tensor generators; other numbers than the single-process preset's).
PER_RANK_INIT_BYTES = 4 << 30


@attrs.frozen(kw_only=True)
class WorkerSpec:
    """What every rank builds (the same on every rank; picklable)."""

    model: str  # a preset name or a checkpoint directory
    dtype: str = "auto"
    seed: int = 0
    config: EngineConfig
    parallel: ParallelConfig
    l2_master: str | None = None  # "host:port" of the shared Mooncake master (l2="mooncake")


@attrs.define
class Rank:
    """One built rank: its engine, the lockstep wrapper (DEP; None: DWDP, independent) and the
    groups (`replicas`: the rank's replica group, its DCP group or the TEP group, None when the
    rank runs its own requests)."""

    rank: int
    world_size: int
    device: torch.device
    groups: ParallelGroups
    control: Group | None
    engine: Engine
    lockstep: object | None  # a LockstepEngine
    shared_l2: object | None = None  # the client of the shared Mooncake tier, if any
    replicas: Group | None = None

    @property
    def answers(self) -> bool:
        """Whether this rank reports to the front end (a replica group's members hold the same
        requests: its leader alone answers)."""
        return self.replicas is None or self.replicas.index == 0

    @property
    def experts(self) -> str:
        """How this rank holds the routed experts: "dep" (split, all-to-all), "tep" (every
        expert, a slice of its intermediate columns), "dwdp" (split, fetched one-sided from the
        peers' shared memory) or "replicated" (all of them)."""
        from tokenspeed.parallel.dwdp import DwdpExperts

        if self.lockstep is not None:
            return "tep" if self.groups.dims.tep > 1 else "dep"
        split = any(isinstance(m, DwdpExperts) for m in self.engine.model.modules())
        return "dwdp" if split else "replicated"

    def step(self, commands: int = 0) -> list:
        """One step of this rank: with its peers (DEP, collective) or alone (DWDP). commands:
        the commands received so far (a replica group leader's count is agreed with its
        members)."""
        return self.engine.step() if self.lockstep is None else self.lockstep.step(commands)

    @property
    def busy(self) -> bool:
        """Whether this rank (DEP: or any peer, at the last step) had work."""
        if self.lockstep is not None and self.lockstep.group_busy:
            return True
        return self.engine.has_unfinished()

    def close(self) -> None:
        """Leave the shared host tier (the engine closes a tier of its own itself)."""
        if self.shared_l2 is not None:
            with contextlib.suppress(Exception):
                self.shared_l2.close()


def dwdp_one_sided() -> bool:
    """Whether `apply_dwdp` can fetch expert weights one-sided (ranks running independently)."""
    from tokenspeed.parallel import apply_dwdp

    return "transport" in inspect.signature(apply_dwdp).parameters


def shared_l2(spec: WorkerSpec):
    """The rank's client of the shared Mooncake tier (None: the engine's own tier)."""
    if spec.l2_master is None:
        return None
    from tokenspeed.cache.l2.mooncake import MooncakeConfig, MooncakeHostCache

    parallel = spec.parallel
    config = MooncakeConfig(
        master_address=spec.l2_master,
        global_segment_bytes=0,  # the segment owner holds the data
        local_buffer_bytes=parallel.l2_buffer_bytes,
        namespace=parallel.l2_namespace,
        op_timeout_s=min(10.0, parallel.timeout_s),
    )
    return MooncakeHostCache(config)


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """The device of a rank: the CPU, or the local_rank-th GPU when the config says CUDA."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def build_rank(spec: WorkerSpec, rank: int, init_method: str, local_rank: int) -> Rank:
    """Join the process group and build this rank (collective: every rank calls it)."""
    from .lockstep import LockstepEngine

    parallel = spec.parallel
    world = parallel.world_size
    device = rank_device(spec.config, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=parallel.timeout_s)
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=world, timeout=timeout
    )
    dims = parallel.dims()
    groups = ParallelGroups.build(dims, device, timeout=timeout)
    control = None
    if not parallel.independent:
        ranks = tuple(range(world))
        handle = dist.new_group(list(ranks), backend="gloo", timeout=timeout)
        control = Group(handle, ranks, rank)
    model, tokenizer = _rank_model(spec, groups, device)
    config = spec.config.evolve(device=str(device))
    replicas, kind = replica_group(groups)
    if kind == "DCP" and device.type == "cuda":
        # DCP attention (the torch reference) syncs with the host: no graph can capture it.
        config = config.evolve(enable_cuda_graph=False)
    l2 = shared_l2(spec)
    # The engine sizes its cache from the model: a DCP member's pages hold page_size / dcp
    # MLA rows, a TEP rank's KDA slots its heads' state (runtime/cache_sizing.py).
    engine = Engine(model, tokenizer, config, l2=l2)
    lockstep = None if control is None else LockstepEngine(engine, control, replicas, kind)
    return Rank(rank, world, device, groups, control, engine, lockstep, l2, replicas)


def replica_group(groups: ParallelGroups) -> tuple[Group | None, str]:
    """This rank's replica group (ranks running the same requests) and its kind: the DCP
    group, the TEP group, or (None, "") when the rank runs its own requests."""
    dims = groups.dims
    if dims.dcp > 1:
        return groups["dcp"], "DCP"
    if dims.tep > 1:
        return groups["tep"], "TEP"
    return None, ""


def _transform(spec: WorkerSpec, model, groups: ParallelGroups, *, loaded: bool) -> None:
    """Split the model for this rank: DEP / TP subgroups (`parallelize`, before loading), or
    DWDP with the one-sided fetch (after loading: it moves the weights in place into shared
    memory), or nothing (replicated ranks, where that fetch does not exist)."""
    if not spec.parallel.independent:
        if not loaded:
            parallelize(model, groups)
    elif loaded and groups.dims.dwdp > 1 and dwdp_one_sided():
        from tokenspeed.parallel import apply_dwdp

        apply_dwdp(model, groups, transport="shared_memory")


def _rank_model(spec: WorkerSpec, groups: ParallelGroups, device: torch.device):
    """This rank's share of the model, and the tokenizer."""
    from .llm import load_model  # llm imports the front end, which imports this module

    if spec.model in PRESETS:
        if draws_per_rank(spec.model):
            return _rank_random_model(spec, groups, device)
        model, tokenizer = load_model(spec.model, dtype=spec.dtype, device=device, seed=spec.seed)
        _transform(spec, model, groups, loaded=False)
        _transform(spec, model, groups, loaded=True)
        return model, tokenizer
    from tokenspeed.model.hf_config import load_config_json
    from tokenspeed.model.layers.moe import use_mxfp4_experts
    from tokenspeed.model.loader import expert_format_of

    from .tokenizer import load_tokenizer

    path = Path(spec.model)
    raw = load_config_json(path)
    config = from_hf_config(raw)
    with torch.device("meta"):
        model = KimiForCausalLM(config)
        if expert_format_of(raw) == "mxfp4":
            use_mxfp4_experts(model)
    _transform(spec, model, groups, loaded=False)
    # DWDP reads every expert here (its one-sided transform needs the weights in place) and
    # keeps its block, in shared memory.
    load_rank_checkpoint(path, model, dtype=spec.dtype, device=device)
    _transform(spec, model, groups, loaded=True)
    return model, load_tokenizer(path, config.eos_token_ids)


def draws_per_rank(preset: str) -> bool:
    """Whether a preset's random weights are drawn per rank (over PER_RANK_INIT_BYTES in fp32)."""
    from tokenspeed.model import get_preset
    from tokenspeed.model.loader import weight_footprint

    return weight_footprint(get_preset(preset), torch.float32).nbytes > PER_RANK_INIT_BYTES


def _rank_random_model(spec: WorkerSpec, groups: ParallelGroups, device: torch.device):
    """A large preset's share for this rank: a meta model, split, then this rank's slices of
    the seeded random single-device model drawn on its device (the same model whatever the
    layout: DEP and TEP over the same weights)."""
    from tokenspeed.model import get_preset
    from tokenspeed.parallel import init_rank_random_weights

    from .llm import _DTYPES, keeps_fp32
    from .tokenizer import ByteTokenizer

    dtype = spec.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    config = get_preset(spec.model)
    with torch.device("meta"):
        model = KimiForCausalLM(config)
    _transform(spec, model, groups, loaded=False)
    init_rank_random_weights(
        model, seed=spec.seed, dtype=_DTYPES[dtype], device=device, keep_fp32=keeps_fp32
    )
    _transform(spec, model, groups, loaded=True)
    return model, ByteTokenizer(config.vocab_size, eos_token_ids=config.eos_token_ids)


class _Sender:
    """Sends messages to the front end from a thread of its own, so that a front end that is
    slow to read never blocks the step loop (and with it every peer's collectives)."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._queue: queue.Queue = queue.Queue()
        self.broken = False
        self._thread = threading.Thread(target=self._run, name="tokenspeed-sender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, EOFError):  # the front end is gone
                self.broken = True
                return

    def __call__(self, message) -> None:
        self._queue.put(message)

    def close(self, timeout: float) -> None:
        """Flush what is queued (for at most `timeout` s)."""
        self._queue.put(None)
        self._thread.join(timeout)


class _Shutdown(Exception):
    """The front end asked this worker to stop."""


class _Inbox:
    """The front end's commands to one rank, applied in the order they came: each as soon as
    it is read, or on a replica group's member, up to the count its group's leader agreed
    (waiting up to `wait_s` for one not yet read: the front end sends each command to every
    member). kind: the replica group's kind, for errors ("DCP", "TEP")."""

    def __init__(self, conn, wait_s: float, kind: str = "DCP") -> None:
        self._conn = conn
        self._wait_s = wait_s
        self._kind = kind
        self._pending: deque = deque()
        self.count = 0  # commands read so far
        self.applied = 0

    def read(self) -> None:
        """Take what has arrived; a shutdown stops the rank at once."""
        while self._conn.poll(0):
            self._take(self._conn.recv())

    def _take(self, command) -> None:
        if command[0] == "shutdown":
            raise _Shutdown
        self._pending.append(command)
        self.count += 1

    def apply(self, upto: int, engine: Engine, send) -> None:
        """Apply the commands up to number `upto`."""
        deadline = time.monotonic() + self._wait_s
        while self.count < upto:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                raise RuntimeError(
                    f"command {self.count + 1} of the front end, which this rank's "
                    f"{self._kind} leader has, did not arrive within {self._wait_s} s"
                )
            self._take(self._conn.recv())
        while self.applied < upto:
            _handle(self._pending.popleft(), engine, send)
            self.applied += 1


def _unsent(message) -> None:
    """Where a replica group's member that is not its leader sends its answers: nowhere."""


def _handle(command, engine: Engine, send) -> None:
    kind = command[0]
    if kind == "add":
        _, rid, ids, params, prompt, session = command
        try:
            engine.add_request(rid, ids, params, prompt=prompt, session=session)
        except RequestError as exc:
            send(("rejected", rid, str(exc)))
    elif kind == "abort":
        _, rid, reason = command
        engine.abort(rid, reason)
    elif kind == "shutdown":
        raise _Shutdown
    else:
        raise ValueError(f"unknown command {command!r}")


def cache_counts(engine: Engine) -> dict[str, int]:
    """The rank's prefix-cache totals since it started: prompt tokens presented, of them hit,
    and of those loaded from the host tier (L2: the shared one, with l2="mooncake")."""
    c = engine.cache.counters
    return {
        "prompt_tokens": c.prompt_tokens,
        "hit_tokens": c.hit_tokens,
        "l2_hit_tokens": c.l2_hit_tokens,
        "objects_published": c.objects_published,
    }


def cache_layout(engine: Engine) -> dict[str, int]:
    """The rank's device cache: pages of page_size tokens (the sink page not counted), the MLA
    rows and bytes of one page (page_size / dcp rows on a DCP member), the tokens it holds,
    and one request's KDA state (a live slot: its heads' share on a TEP rank)."""
    geometry, sizes = engine.cache.geometry, engine.cache.sizes
    pages = sizes.num_pages - 1
    return {
        "page_size": geometry.page_size,
        "num_pages": pages,
        "mla_rows_per_page": geometry.mla_rows_per_page,
        "mla_page_bytes": geometry.mla_page_bytes,
        "token_capacity": pages * geometry.page_size,
        "kda_state_bytes": geometry.kda_state_bytes,
    }


def serve(built: Rank, commands, send, wait_s: float = 60.0) -> None:
    """The step loop of a spawned rank, until a shutdown command (or EOFError when the front
    end's pipe closes). wait_s: how long a replica group's member waits for a command its
    leader has."""
    engine = built.engine
    replicated = built.replicas is not None
    inbox = _Inbox(commands, wait_s, built.lockstep.kind if replicated else "DCP")
    reply = send if built.answers else _unsent
    idle = 0.0
    while True:
        inbox.read()
        agreed = built.lockstep.commands_agreed if replicated else inbox.count
        inbox.apply(agreed, engine, reply)
        outputs = built.step(inbox.count)
        if outputs and built.answers:
            send(("out", outputs, cache_counts(engine)))
        waiting = replicated and built.lockstep.commands_agreed > inbox.applied
        if built.busy or waiting:
            idle = 0.0
        else:  # nobody has anything to do: wait for a command, a little longer each time
            idle = min(IDLE_WAIT_S, max(2 * idle, 0.001))
            commands.poll(idle)


def _shutting_down(commands, wait_s: float = 1.0) -> bool:
    """Whether the front end has asked this worker to stop (or is gone), waiting up to wait_s:
    a peer that exits on shutdown fails the collectives of the others first."""
    try:
        while commands.poll(wait_s):
            if commands.recv()[0] == "shutdown":
                return True
    except (EOFError, OSError):
        return True
    return False


def worker_main(spec: WorkerSpec, rank: int, port: int, commands, results) -> None:
    """The target of a spawned worker process."""
    # Ctrl-C reaches the whole process group: the front end decides what its workers do.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    send = _Sender(results)
    code = 0
    built = None
    try:
        built = build_rank(spec, rank, f"tcp://127.0.0.1:{port}", local_rank=rank)
        engine = built.engine
        send(("ready", rank, os.getpid(), engine.config, built.experts, cache_layout(engine)))
        serve(built, commands, send, wait_s=spec.parallel.timeout_s)
    except (_Shutdown, EOFError, BrokenPipeError):
        if built is not None:
            built.close()  # asked to stop, or the front end is gone: leave the store cleanly
    except BaseException as exc:
        if not _shutting_down(commands):
            detail = traceback.format_exc()
            send(("error", rank, f"{type(exc).__name__}: {exc}", detail))
            code = 1
    finally:
        send.close(timeout=5.0)
    # Straight out: the interpreter's teardown (torch's, the process group's with peers gone)
    # only delays the front end's join; nothing of a worker outlives it.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------- torchrun


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tokenspeed.runtime.worker",
        description="One rank of a multi-rank engine under torchrun (rank 0 prints the outputs).",
    )
    parser.add_argument("--model", default="tiny", help="a preset name or a checkpoint directory")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=None, help="default: the world size")
    parser.add_argument("--dcp", type=int, default=1, help="DCP group size (default: none)")
    parser.add_argument("--tep", type=int, default=1, help="TEP over every rank (the world size)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--prompt-ids", help="JSON list of token-id lists, or a file holding one")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--decode-steps", type=int, default=8)
    return parser.parse_args(argv)


def _read_prompts(args, tokenizer) -> list[tuple[str | None, list[int]]]:
    prompts: list[tuple[str | None, list[int]]] = []
    if args.prompt_ids:
        text = args.prompt_ids
        if not text.lstrip().startswith("["):
            text = Path(text).read_text()
        prompts += [(None, [int(t) for t in ids]) for ids in json.loads(text)]
    for text in args.prompt:
        if tokenizer is None:
            raise SystemExit("--prompt needs a tokenizer; this model has none (use --prompt-ids)")
        prompts.append((text, tokenizer.encode(text)))
    if not prompts:
        raise SystemExit("give --prompt-ids or --prompt")
    return prompts


def run_torchrun(argv: list[str] | None = None) -> None:
    """Serve one batch of prompts on the ranks torchrun started (RANK, WORLD_SIZE, LOCAL_RANK
    and the rendezvous in the environment)."""
    from tokenspeed.sched.config import RouterConfig
    from tokenspeed.sched.router import Router

    from .parallel_config import model_config_of

    args = _parse(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    parallel = ParallelConfig(
        world_size=world,
        tp=args.tp,
        ep=args.ep,
        dcp=args.dcp,
        tep=args.tep,
        timeout_s=args.timeout_s,
    )
    parallel.check_model(model_config_of(args.model))
    options = {"max_num_seqs": args.max_num_seqs, "decode_steps": args.decode_steps}
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    config = EngineConfig(device=args.device, seed=args.seed, **options)
    spec = WorkerSpec(
        model=args.model, dtype=args.dtype, seed=args.seed, config=config, parallel=parallel
    )
    parallel.check_engine(config)
    built = build_rank(spec, rank, "env://", local_rank)
    engine, control = built.engine, built.control
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    # Rank 0 is the front end: it reads the prompts and places them by least outstanding work,
    # on a rank (or on a replica group, DCP or TEP: every member runs it).
    groups = parallel.attention_dp
    placed: list = [None]
    if rank == 0:
        router, loads = Router(RouterConfig(num_prefill_ranks=groups)), [0] * groups
        limit = engine.config.max_model_len
        placement = []
        try:
            prompts = _read_prompts(args, engine.tokenizer)
            for index, (text, ids) in enumerate(prompts):
                ids = check_prompt(
                    index,
                    ids,
                    params,
                    vocab_size=engine.model.config.vocab_size,
                    max_model_len=limit,
                    has_tokenizer=engine.tokenizer is not None,
                )
                target = router.pick_prefill(loads)
                loads[target] += len(ids) + min(params.max_tokens, limit - len(ids))
                placement.append((target, index, text, ids))
            placed = [placement]
        except (RequestError, SystemExit, OSError, ValueError) as exc:
            placed = [str(exc)]  # every rank stops, naming it
    dist.broadcast_object_list(placed, src=0, group=control.handle)
    if isinstance(placed[0], str):
        dist.destroy_process_group()
        raise SystemExit(placed[0])
    for target, index, text, ids in placed[0]:
        if target == rank // parallel.replicas:
            engine.add_request(index, ids, params, prompt=text)
    finished = {}
    flag = torch.zeros(1, dtype=torch.int32)
    while True:
        for out in built.step():
            if out.finished:
                finished[out.request_id] = out
        flag.fill_(int(engine.has_unfinished()))
        dist.all_reduce(flag, group=control.handle)  # every rank stops at the same step
        if not flag.item():
            break
    mine = [(i, o.token_ids, o.text, o.outputs[0].finish_reason) for i, o in finished.items()]
    if not built.answers:
        mine = []  # its group's leader reports the same outputs
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0, group=control.handle)
    if rank == 0:
        rows = sorted(row for part in gathered for row in part)
        for index, token_ids, text, reason in rows:
            row = {"index": index, "token_ids": token_ids, "text": text, "finish_reason": reason}
            print(json.dumps(row), flush=True)
    dist.barrier(group=control.handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    run_torchrun()
