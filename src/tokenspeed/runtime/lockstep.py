"""`LockstepEngine`: one rank of a group of engines whose model forwards are coupled.

Under DEP every forward of the model issues the same collectives on every rank of the expert
group (the MoE all-to-alls), so the ranks must issue the same number of forwards, in step, even
though each has its own requests, scheduler and cache. Each step they agree on that number:

    lock = LockstepEngine(engine, control)     # control: a gloo Group over the coupled ranks
    lock.engine.add_request(...)                # requests go to this rank's own engine
    while True:                                 # every rank of `control` runs this loop
        outputs = lock.step()                   # (at least once: a rank with no requests too)
        if not lock.engine.has_unfinished() and not lock.group_busy:
            break                               # every rank leaves at the same step

Replica groups (`replicas`: groups of the control ranks whose members run the same requests:
decode context parallelism, the MLA rows split between the members, or TEP, heads and expert
columns split, one group spanning the world) ride on the same all-reduce: each member also
sends a digest of its plan and of its previous step's outputs, so members that would run
different steps (or sampled different tokens) stop with a LockstepError before their forwards
pair the wrong collectives; and the group's first member (its leader) sends how many commands
it has received, the count every member applies before its next step (`commands_agreed`), so
that a request reaches every member's scheduler at the same step.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from tokenspeed.parallel.groups import Group

from .engine import Engine, StepError
from .outputs import RequestOutput

__all__ = ["LockstepEngine", "LockstepError"]


class LockstepError(RuntimeError):
    """The group's forwards are out of step (or its control collective failed): this rank cannot
    go on with its peers. The group is broken: peers waiting in a collective fail by the group's
    timeout; the rank's engine must not be stepped again (tear the group down)."""


class LockstepEngine:
    """One rank of a group of engines whose model forwards are coupled (DEP: the MoE
    all-to-alls of every forward join all ranks of the expert group).

    Contract:
    - `step()` is collective: every rank of `control` calls it in its loop, the same number of
      times, with or without work of its own. It plans this rank's step (`Engine.plan_step`),
      counts the plan's model forwards n (`Engine.forwards_in`), and agrees with the others in
      one all-reduce (MAX) on `control` of [n, has_unfinished] (a CPU int64 tensor; `control` is
      a gloo group whatever the model's device, and its timeout bounds the wait). It then runs
      its plan (`Engine.run_plan`) and `N - n` empty forwards (`Engine.idle_forward`), N being
      the group's maximum, and returns this rank's outputs. When no rank has a forward to run,
      no forward runs (a cheap idle iteration: the all-reduce only).
    - `group_busy`: whether any rank had unfinished requests when the last step was planned
      (before it ran). The loop above leaves after the first step at which no rank had any, on
      every rank at once: they all see the same value, and a rank with nothing before a step has
      nothing after it. (`while has_unfinished() or group_busy` would not do: a rank without
      requests would skip a new round, `group_busy` being False from the last one.) Requests
      added later on one rank need every rank to enter `step()` again (the front end tells
      them all).
    - `engine`: the wrapped engine; add_request and abort go to it directly, between steps.
    - `replicas`: this rank's replica group (None or one rank: none), its ranks running the
      same requests (a DCP group; the TEP group), a run of whole groups tiling `control`;
      `kind` names it in errors ("DCP", "TEP"). Its members must be given the same commands in
      the same order; `step(commands=)` takes the count the leader has received (ignored on the
      others) and `commands_agreed` is, after the step, the leader's count, which every member
      applies before its next step. The all-reduce then also carries each group's [leader's
      count, max digest, -min digest]: a member whose plan or previous outputs differ from its
      peers' raises LockstepError (on every member of the group at once, before any forward).

    Failures. A plan's forwards are counted by the runner as they begin and end:
    - `run_plan` raises `StepError` between forwards (sampling, host bookkeeping): the rank's
      collectives are whole, so it still runs empty forwards up to N, keeping its peers in step,
      and then raises the StepError (its batch aborted, as `Engine.step` does). The group goes on.
    - If it fails inside a forward, that forward's collectives may be half issued: no forward
      can pair with the peers' any more. LockstepError (chained to the cause) is raised at once;
      the peers, blocked in a collective of that forward or of the next, fail by the group's
      timeout. So does an interrupt (KeyboardInterrupt), raised as it is.
    - A plan that issued a number of forwards other than `forwards_in` said (a bug: peers would
      deadlock or pair the wrong collectives) raises LockstepError, after topping up to N when it
      issued fewer, so that the peers finish the step.
    """

    def __init__(
        self,
        engine: Engine,
        control: Group,
        replicas: Group | None = None,
        kind: str = "DCP",
    ) -> None:
        self.engine = engine
        self.control = control
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self.kind = kind
        self.commands_agreed = 0  # replicas: the leader's command count at the last step
        self._outputs_digest = _digest(())
        group = self.replicas
        if group is not None:
            if set(group.ranks) - set(control.ranks) or control.size % group.size:
                raise ValueError(
                    f"the {kind} group {group.ranks} does not tile the control group "
                    f"{control.ranks}"
                )
            self._slot = control.ranks.index(group.ranks[0]) // group.size
        self._busy = False
        self.steps = 0  # step() calls
        self.forwards = 0  # forwards this rank ran for its own plans
        self.idle_forwards = 0  # empty forwards run to keep in step with the group

    @property
    def group_busy(self) -> bool:
        """Whether any rank of the group had unfinished requests at the last `step()`."""
        return self._busy

    def step(self, commands: int = 0) -> list[RequestOutput]:
        """One step of the group (collective on `control`); this rank's outputs. commands: in a
        replica group, how many commands this rank (the leader's count is agreed) has received
        so far."""
        engine = self.engine
        plan = engine.plan_step()
        n = engine.forwards_in(plan)
        total = self._agree(n, engine.has_unfinished(), plan, commands)
        self.steps += 1
        runner = engine.runner
        started, done = runner.forwards_started, runner.forwards_done
        error: StepError | None = None
        try:
            outputs = engine.run_plan(plan)
        except StepError as exc:
            error = exc
        issued = runner.forwards_started - started
        self.forwards += issued
        if issued != runner.forwards_done - done:
            raise LockstepError(
                f"rank {self.control.rank}: a forward failed midway ({issued} begun, "
                f"{runner.forwards_done - done} completed of {total} agreed); the group is "
                "broken and its peers fail by its collective timeout"
            ) from error
        if issued > total:
            raise LockstepError(
                f"rank {self.control.rank}: its plan issued {issued} forwards, more than the "
                f"{total} the group agreed (forwards_in said {n}); the group is broken"
            ) from error
        for _ in range(total - issued):
            try:
                engine.idle_forward()
            except Exception as exc:
                raise LockstepError(
                    f"rank {self.control.rank}: an empty forward failed; the group is broken"
                ) from exc
            self.idle_forwards += 1
        if error is not None:
            raise error
        if self.replicas is not None:
            self._outputs_digest = _digest(_output_summary(outputs))
        if issued != n:
            raise LockstepError(
                f"rank {self.control.rank}: its plan issued {issued} forwards but forwards_in "
                f"said {n} (the group ran {total}); the forward count is wrong"
            )
        return outputs

    def _agree(self, forwards: int, unfinished: bool, plan=None, commands: int = 0) -> int:
        """The group's maximum of `forwards`; sets `group_busy` (any rank unfinished) and, in a
        replica group, `commands_agreed` (after checking the members agree)."""
        values = [forwards, int(unfinished)]
        if self.replicas is not None:
            values += self._replica_values(plan, commands)
        agreed = torch.tensor(values, dtype=torch.int64)
        if self.control.size > 1:
            try:
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.control.handle)
            except Exception as exc:
                raise LockstepError(
                    f"rank {self.control.rank}: the step's all-reduce on the control group "
                    f"{self.control.ranks} failed (a peer gone or out of step); this engine must "
                    "not be stepped again"
                ) from exc
        total, busy, *rest = agreed.tolist()
        self._busy = bool(busy)
        if self.replicas is not None:
            self._check_replicas(rest)
        return total

    def _replica_values(self, plan, commands: int) -> list[int]:
        """This rank's entries of the replica part of the all-reduce: NONE for every other
        group's three slots (MAX ignores them), [the leader's count, digest, -digest] for its
        own."""
        values = [NONE] * (3 * (self.control.size // self.replicas.size))
        digest = _digest((_plan_summary(plan), self._outputs_digest))
        count = commands if self.replicas.index == 0 else NONE
        values[3 * self._slot : 3 * self._slot + 3] = [count, digest, -digest]
        return values

    def _check_replicas(self, values: list[int]) -> None:
        count, most, least = values[3 * self._slot : 3 * self._slot + 3]
        if most != -least:
            raise LockstepError(
                f"rank {self.control.rank}: the members of {self.kind} group "
                f"{self.replicas.ranks} disagree on this step's plan or on the tokens of their "
                "last step (they must run the same requests and sample the same tokens); the "
                "group is broken"
            )
        self.commands_agreed = count


# The value of a slot a rank has nothing to say about in the MAX all-reduce.
NONE = torch.iinfo(torch.int64).min


def _digest(value) -> int:
    """A non-negative int63 digest of `value`'s repr (the same on every process, unlike
    hash(), which Python salts per process for strings)."""
    raw = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def _plan_summary(plan) -> tuple:
    """What a plan runs: each prefill chunk's request and token range, the decode batch."""
    prefill = () if plan.prefill is None else plan.prefill.chunks
    chunks = tuple((repr(c.request.rid), c.start, c.end, c.checkpoints, c.is_last) for c in prefill)
    decode = plan.decode
    rows = () if decode is None else tuple(repr(r.rid) for r in decode.requests)
    return chunks, rows, None if decode is None else (decode.padded_size, decode.steps)


def _output_summary(outputs: list[RequestOutput]) -> tuple:
    """What a step returned: each request's token count, last tokens and end."""
    return tuple(
        (repr(o.request_id), len(o.token_ids), tuple(o.token_ids[-8:]), o.finished) for o in outputs
    )
