"""Replay an AgentX-style workload through the real engine (`tokenspeed bench agentx`).

Sessions come from `tokenspeed.workload.AgentXWorkload`, scaled down so that the `tiny`
preset replays them on a CPU in seconds, or from an aiperf `dataset.jsonl` (`trace_sessions`:
the file aiperf's agentic workload writes and replays against a server, read as the simulator
reads it, its token counts scaled the same way). A trace block id becomes `block_size` token
ids drawn from a generator seeded by the id, so equal block ids are equal text (the shared
prefixes hit); each turn's prompt is the session's history: earlier prompts, the outputs the
engine actually generated, then the turn's new tokens. Up to `concurrency` sessions run at once;
a session's next turn is submitted when its previous one finishes (inter-turn delays are not
waited out: this measures the engine, not the clock). Subagents run as sessions of their own.

The engine is an `Engine` or a `MultiRankEngine` (runtime/multirank.py: the same add_request /
step / has_unfinished interface over worker processes). A multi-rank replay also reports each
rank's load (what the front end placed on it), its prefix hit rate (from its requests' outputs)
and the imbalance over the ranks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import numpy as np

from tokenspeed.workload import AgentXConfig, AgentXWorkload, Session, load_aiperf_dataset

from .engine import Engine
from .metrics import EngineMetrics
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .multirank import MultiRankEngine


class ReplayError(ValueError):
    """Replay arguments that cannot work; the message names the argument."""


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ReplayError(f"{name} must be a positive integer, got {value!r}")


def small_agentx(scale: float = 1 / 64) -> AgentXConfig:
    """AgentX's shape with every token count multiplied by `scale`."""
    base = AgentXConfig()

    def s(dist):
        return attrs.evolve(
            dist, mean=max(dist.mean * scale, 2.0), median=max(dist.median * scale, 1.0)
        )

    block = max(int(base.block_size * scale), 8)
    return attrs.evolve(
        base,
        shared_prefix_tokens=int(base.shared_prefix_tokens * scale),
        group_prefix_tokens=int(base.group_prefix_tokens * scale),
        session_context=s(base.session_context),
        new_tokens=s(base.new_tokens),
        output_tokens=s(base.output_tokens),
        subagent_context=s(base.subagent_context),
        max_prompt_tokens=int(base.max_prompt_tokens * scale),
        block_size=block,
    )


def _turns_in(turns) -> int:
    """How many turns `turns` hold, counting those of the subagent sessions they launch, and
    of the subagents those launch, and so on."""
    return sum(1 + sum(_turns_in(sub.turns) for sub in turn.subagents) for turn in turns)


def block_tokens(block_id: int, count: int, vocab: int) -> list[int]:
    rng = np.random.default_rng([0x70C5, block_id])
    return rng.integers(3, vocab, size=count).tolist()


def _model_config(engine):
    """The model's configuration: a MultiRankEngine's model lives in its workers, and its
    front end holds the configuration (`model_config`)."""
    config = getattr(engine, "model_config", None)
    return config if config is not None else engine.model.config


@attrs.define
class _RankTally:
    """What one rank's finished requests report (a MultiRankEngine's metrics live in its
    workers; its front end reports the load it placed)."""

    metrics: EngineMetrics = attrs.Factory(EngineMetrics)
    generated: int = 0

    def record(self, out) -> None:
        """A finished request's output, counted as the engine's own metrics count it."""
        m = out.metrics
        if m.first_scheduled_time is not None:
            self.metrics.record_admission(len(out.prompt_token_ids), m.cached_tokens)
        if m.ttft is not None:
            self.metrics.record_ttft(m.ttft)
        if out.outputs[0].finish_reason != "abort":
            self.metrics.record_finished(m.first_token_time, m.last_token_time, len(out.token_ids))
        self.generated += len(out.token_ids)


def _merged(tallies: list[_RankTally]) -> EngineMetrics:
    total = EngineMetrics()
    for tally in tallies:
        m = tally.metrics
        total.record_admission(m.prompt_tokens, m.cached_tokens)
        total.ttfts += m.ttfts
        total.request_itls += m.request_itls
    return total


@attrs.define
class _Live:
    session: Session
    turn: int = 0
    history: list[int] = attrs.Factory(list)


def replay(
    engine: Engine | MultiRankEngine,
    sessions: list[Session],
    concurrency: int,
    block_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Run every turn of `sessions` (subagents included); returns throughput and latency.

    A turn whose prompt no longer leaves room for one output token under `max_model_len` ends
    its session there. `skipped_turns` counts every turn that was therefore never sent: that
    turn, the session's later turns, and all turns of the subagent sessions those turns would
    have launched (a subagent starts when its turn finishes). So `requests + skipped_turns` is
    every turn of `sessions`, subagents included. `p90_interactivity_tok_s` is the engine's:
    1 / the P90 of per-request mean inter-token latency, as the simulator scores it.

    progress: called as `progress(done, total)` whenever turns finish or are skipped, `total`
    being every turn of `sessions` (subagents included). A replay that skips every turn (its
    first prompts already too long for max_model_len) raises ReplayError: it measured nothing.

    A multi-rank engine (one with `load_report()`, a `MultiRankEngine`): the latency and hit
    rate come from the requests' outputs (their metrics, as each rank's engine recorded them),
    and the result also holds `request_imbalance` and `token_imbalance` (max / mean over the
    ranks of the requests and tokens placed) and `ranks`: per rank, a dict of `rank`,
    `requests`, `tokens` (placed: prompt + most new tokens), `generated_tokens` and
    `prefix_hit_rate` (its requests' cached prompt tokens over their prompt tokens).
    """
    # With no session allowed to run, nothing is ever submitted and the loop below would step an
    # idle engine forever.
    _check_positive_int("concurrency", concurrency)
    _check_positive_int("block_size", block_size)
    vocab = _model_config(engine).vocab_size
    limit = engine.config.max_model_len
    load_report = getattr(engine, "load_report", None)  # a MultiRankEngine's
    tallies: list[_RankTally] = []
    rank_of: dict[object, int] = {}
    queue = deque(sessions)
    live: dict[object, _Live] = {}
    generated = requests = skipped = finished = 0
    total = sum(_turns_in(session.turns) for session in sessions)
    shortest_skipped: int | None = None  # the shortest prompt of a skipped turn
    unique = np.random.default_rng(0x0A9E)  # tokens without a block id: no one else's content
    start = time.monotonic()

    def new_tokens(turn) -> list[int]:
        """A turn's `new_tokens` tokens: `block_size` per block id (the last one may be partial),
        then, past its ids (a trace's un-hashed tail; the whole turn when it has none), tokens
        unique to this turn. Without them a turn with no ids would add nothing to the prompt,
        and a first turn would be an empty prompt, which the engine refuses."""
        new: list[int] = []
        for block in turn.blocks:
            count = min(block_size, turn.new_tokens - len(new))
            if count < 1:
                break
            new += block_tokens(block, count, vocab)
        if len(new) < turn.new_tokens:
            new += unique.integers(3, vocab, size=turn.new_tokens - len(new)).tolist()
        return new

    def report() -> None:
        if progress is not None:
            progress(finished + skipped, total)

    def submit(state: _Live) -> bool:
        nonlocal requests, skipped, shortest_skipped
        turn = state.session.turns[state.turn]
        prompt = state.history + new_tokens(turn)
        # The engine takes a prompt shorter than max_model_len and generates up to the limit.
        max_tokens = min(turn.output_tokens, limit - len(prompt))
        if max_tokens < 1:
            # The conversation outgrew the model's limit: it ends here, and nothing this turn or
            # a later one would have started (their subagents) runs either.
            skipped += _turns_in(state.session.turns[state.turn :])
            shortest_skipped = min(len(prompt), shortest_skipped or len(prompt))
            report()
            return False
        state.history = prompt
        rid = (state.session.sid, state.turn)
        placed = engine.add_request(
            rid,
            prompt,
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            session=state.session.sid,
        )
        if load_report is not None:  # a multi-rank engine returns the rank it placed it on
            rank_of[rid] = placed
            tallies.extend(_RankTally() for _ in range(placed + 1 - len(tallies)))
        live[rid] = state
        requests += 1
        return True

    while queue or live:
        while queue and len(live) < concurrency:
            submit(_Live(queue.popleft()))
        for out in engine.step():
            if not out.finished:
                continue
            state = live.pop(out.request_id)
            generated += len(out.token_ids)
            if load_report is not None:
                tallies[rank_of.pop(out.request_id)].record(out)
            finished += 1
            report()
            state.history = state.history + out.token_ids
            turn = state.session.turns[state.turn]
            queue.extend(turn.subagents)
            state.turn += 1
            if state.turn < len(state.session.turns):
                submit(state)
    seconds = time.monotonic() - start
    if requests == 0 and skipped:
        raise ReplayError(
            f"every turn ({skipped}) was skipped: the shortest first prompt has "
            f"{shortest_skipped} tokens, which leaves no room for an output token under "
            f"max_model_len={limit}; raise max_model_len above {shortest_skipped} or lower the "
            "scale (shorter turns)"
        )
    # A multi-rank engine's own metrics live in its workers: its outputs' metrics tell.
    summary = engine.metrics.summary() if load_report is None else _merged(tallies).summary()
    result = {
        "sessions": len(sessions),
        "requests": requests,
        "skipped_turns": skipped,
        "generated_tokens": generated,
        "seconds": seconds,
        "output_tokens_per_s": generated / seconds if seconds else None,
        "ttft_mean_s": summary["ttft_mean_s"],
        "ttft_p90_s": summary["ttft_p90_s"],
        "p90_interactivity_tok_s": summary["p90_interactivity_tok_s"],
        "prefix_hit_rate": summary["prefix_hit_rate"],
    }
    # Speculative decoding (single rank): tokens emitted per verify step, and per draft
    # position the fraction of proposed drafts accepted; only once a step speculated.
    for key in ("spec_mean_acceptance_length", "spec_acceptance_rates"):
        if key in summary:
            result[key] = summary[key]
    if load_report is not None:
        result.update(_rank_results(load_report(), tallies))
    return result


def _rank_results(report, tallies: list[_RankTally]) -> dict:
    """Per-rank load and hit rate of a multi-rank replay, and the imbalance over the ranks."""
    ranks = []
    for load in report.ranks:
        tally = tallies[load.rank] if load.rank < len(tallies) else _RankTally()
        ranks.append(
            {
                "rank": load.rank,
                "requests": load.requests,
                "tokens": load.tokens,
                "generated_tokens": tally.generated,
                "prefix_hit_rate": tally.metrics.hit_rate,
            }
        )
    return {
        "request_imbalance": report.request_imbalance,
        "token_imbalance": report.token_imbalance,
        "ranks": ranks,
    }


def agentx_sessions(num_sessions: int, seed: int, scale: float, max_turns: int) -> tuple:
    """`num_sessions` sessions of `small_agentx(scale)`, and the block size their ids stand for."""
    _check_positive_int("num_sessions", num_sessions)
    _check_positive_int("max_turns", max_turns)
    if not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        raise ReplayError(f"scale must be a finite number > 0, got {scale!r}")
    try:
        config = attrs.evolve(small_agentx(scale), max_turns=max_turns)
    except ValueError as err:  # token counts rounded down to nothing
        raise ReplayError(f"scale {scale:g} leaves no usable AgentX workload: {err}") from err
    workload = AgentXWorkload(config, seed=seed)
    return [workload.session(i) for i in range(num_sessions)], config.block_size


def _scaled(session: Session, scale: float) -> Session:
    """The session with every turn's token counts times `scale` (at least one token each)."""
    turns = tuple(
        attrs.evolve(
            turn,
            new_tokens=max(1, round(turn.new_tokens * scale)),
            output_tokens=max(1, round(turn.output_tokens * scale)),
            subagents=tuple(_scaled(sub, scale) for sub in turn.subagents),
        )
        for turn in session.turns
    )
    return attrs.evolve(session, turns=turns)


def trace_sessions(path, num_sessions: int, scale: float) -> tuple[list[Session], int]:
    """The first `num_sessions` sessions of an aiperf `dataset.jsonl` (its lines that do not
    parse are skipped, as the simulator skips them), with token counts and the block size
    times `scale`, and that block size. Equal block ids stay equal text, so the prefixes the
    trace shares still hit."""
    _check_positive_int("num_sessions", num_sessions)
    if not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        raise ReplayError(f"scale must be a finite number > 0, got {scale!r}")
    try:
        workload = load_aiperf_dataset(path)
    except (OSError, ValueError) as err:
        raise ReplayError(f"cannot read the aiperf dataset {str(path)!r}: {err}") from err
    if not workload.sessions:
        raise ReplayError(f"the aiperf dataset {str(path)!r} holds no session")
    block = max(1, round(workload.block_size * scale))
    sessions = [_scaled(s, scale) for s in workload.sessions[:num_sessions]]
    return sessions, block
