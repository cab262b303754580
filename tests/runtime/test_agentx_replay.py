"""The AgentX replay (`tokenspeed bench agentx`) refuses arguments it cannot run with."""

import math
from types import SimpleNamespace

import pytest

from tokenspeed.runtime.agentx_replay import ReplayError, agentx_sessions, block_tokens, replay


class _IdleEngine:
    """Just enough of an Engine for `replay` to start; stepping it means the replay submitted
    nothing and would step an idle engine forever."""

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=512))
    config = SimpleNamespace(max_model_len=4096)

    def add_request(self, *args, **kwargs):
        raise AssertionError("replay submitted a request")

    def step(self):
        raise AssertionError("replay stepped an engine with nothing submitted")


@pytest.mark.parametrize("concurrency", [0, -1, 1.5, True])
def test_replay_refuses_a_concurrency_that_runs_nothing(concurrency):
    sessions, block = agentx_sessions(1, 0, 1 / 128, 1)
    # A ValueError (ReplayError) for library callers, not only for the command.
    message = f"concurrency must be a positive integer, got {concurrency}"
    with pytest.raises(ValueError, match=message):
        replay(_IdleEngine(), sessions, concurrency, block)


def test_replay_refuses_a_block_size_below_one():
    sessions, _ = agentx_sessions(1, 0, 1 / 128, 1)
    with pytest.raises(ReplayError, match="block_size must be a positive integer, got 0"):
        replay(_IdleEngine(), sessions, 2, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_sessions": 0}, "num_sessions must be a positive integer, got 0"),
        ({"max_turns": 0}, "max_turns must be a positive integer, got 0"),
        ({"max_turns": -2}, "max_turns must be a positive integer, got -2"),
        ({"scale": 0.0}, "scale must be a finite number > 0, got 0.0"),
        ({"scale": -1.0}, "scale must be a finite number > 0, got -1.0"),
        ({"scale": math.inf}, "scale must be a finite number > 0, got inf"),
        ({"scale": 1e-6}, "scale 1e-06 leaves no usable AgentX workload"),
    ],
)
def test_agentx_sessions_refuses_counts_and_scales_that_make_no_workload(kwargs, message):
    args = {"num_sessions": 2, "seed": 0, "scale": 1 / 128, "max_turns": 2} | kwargs
    with pytest.raises(ReplayError, match=message):
        agentx_sessions(**args)


def _recording_engine(model, max_model_len):
    """A real engine (tiny model, CPU) that also records the prompt and max_tokens of each
    request the replay submits."""
    from tokenspeed.runtime import Engine, EngineConfig

    engine = Engine(
        model, None, EngineConfig(max_num_seqs=2, max_model_len=max_model_len, page_size=16)
    )
    submitted = []
    add = engine.add_request

    def add_request(rid, prompt, params, **kwargs):
        submitted.append((rid, list(prompt), params.max_tokens))
        add(rid, prompt, params, **kwargs)

    engine.add_request = add_request
    return engine, submitted


def test_turns_without_block_ids_still_add_their_new_tokens(tiny):
    """A trace turn whose tokens have no (or too few) block ids: the un-hashed tokens are unique
    content, not nothing; a first turn without ids used to be an empty prompt, which the engine
    refuses, ending the whole replay."""
    from tokenspeed.workload.model import Session, Turn

    turns = (
        Turn(new_tokens=5, output_tokens=3),  # no block ids at all
        Turn(new_tokens=20, output_tokens=2, blocks=(7,)),  # one id for the first 16 tokens
    )
    engine, submitted = _recording_engine(tiny, max_model_len=128)
    result = replay(engine, [Session(sid="s", turns=turns)], concurrency=1, block_size=16)
    assert result["requests"] == 2 and result["skipped_turns"] == 0
    assert result["generated_tokens"] == 5
    (_, first, _), (_, second, _) = submitted
    assert len(first) == 5 and len(second) == 5 + 3 + 20
    assert second[8:24] == block_tokens(7, 16, 512)  # the block's tokens, then 4 unique ones


def test_turns_use_the_room_up_to_max_model_len_and_stop_past_it(tiny):
    """The engine serves a prompt of max_model_len - 1 tokens with one output token, and caps
    an output to the room left; the turn after one that filled the context is skipped."""
    from tokenspeed.workload.model import Session, Turn

    limit = 32
    sessions = [
        Session(sid="edge", turns=(Turn(new_tokens=limit - 1, output_tokens=4, blocks=(1, 2)),)),
        Session(
            sid="long",
            turns=(
                Turn(new_tokens=10, output_tokens=1000, blocks=(3,)),  # past the limit
                Turn(new_tokens=1, output_tokens=1, blocks=(4,)),
            ),
        ),
    ]
    engine, submitted = _recording_engine(tiny, max_model_len=limit)
    result = replay(engine, sessions, concurrency=2, block_size=16)
    assert [(rid, len(p), m) for rid, p, m in submitted] == [
        (("edge", 0), limit - 1, 1),
        (("long", 0), 10, limit - 10),
    ]
    assert result["requests"] == 2 and result["skipped_turns"] == 1
    assert result["generated_tokens"] == 1 + (limit - 10)


def test_skipped_turns_count_every_turn_never_sent(tiny):
    """A turn that no longer fits ends its session: its later turns, and the subagent sessions
    those turns would have launched, are never sent either. They used to go uncounted (one skip
    per ended session), so requests + skipped_turns fell short of the workload's turns."""
    from tokenspeed.workload.model import Session, Turn

    def sub(sid):
        return Session(sid=sid, turns=(Turn(new_tokens=1, output_tokens=1),) * 2, kind="subagent")

    limit = 32
    long = Session(
        sid="long",
        turns=(
            Turn(new_tokens=10, output_tokens=1000, blocks=(3,)),  # fills the context
            Turn(new_tokens=1, output_tokens=1, subagents=(sub("a"),)),  # skipped
            Turn(new_tokens=1, output_tokens=1),
            Turn(new_tokens=1, output_tokens=1, subagents=(sub("b"), sub("c"))),
        ),
    )
    short = Session(sid="short", turns=(Turn(new_tokens=4, output_tokens=2),))
    engine, submitted = _recording_engine(tiny, max_model_len=limit)
    result = replay(engine, [long, short], concurrency=2, block_size=16)
    assert sorted(rid for rid, _, _ in submitted) == [("long", 0), ("short", 0)]
    # Turns 1-3 of "long", and the two turns of each of its three subagents.
    assert result["requests"] == 2 and result["skipped_turns"] == 3 + 3 * 2


def test_a_replay_that_skips_every_turn_is_an_error_saying_why(tiny):
    """A max_model_len below every first prompt sends nothing: the replay must not report a
    table of zeros as a result."""
    from tokenspeed.runtime import Engine, EngineConfig

    sessions, block = agentx_sessions(2, 0, 1 / 128, 2)
    engine = Engine(tiny, None, EngineConfig(device="cpu", max_model_len=16, page_size=16))
    with pytest.raises(ReplayError) as info:
        replay(engine, sessions, 2, block)
    message = str(info.value)
    assert "every turn" in message and "skipped" in message
    assert "max_model_len=16" in message and "raise max_model_len" in message


def test_replay_reports_its_progress_turn_by_turn(tiny):
    from tokenspeed.runtime import Engine, EngineConfig

    sessions, block = agentx_sessions(3, 0, 1 / 128, 2)
    engine = Engine(tiny, None, EngineConfig(device="cpu", max_model_len=2048, page_size=16))
    seen = []
    result = replay(
        engine, sessions, 2, block, progress=lambda done, total: seen.append((done, total))
    )
    total = result["requests"] + result["skipped_turns"]
    assert seen and all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total


class _TwoRanksOfOneEngine:
    """A real engine behind a multi-rank front end's interface: requests alternate between two
    "ranks" (add_request returns the rank), `load_report()` reports what was placed, and the
    model lives elsewhere (only `model_config`), as with a MultiRankEngine."""

    def __init__(self, model) -> None:
        from tokenspeed.runtime import Engine, EngineConfig
        from tokenspeed.runtime.multirank import RankLoad

        self.inner = Engine(model, None, EngineConfig(device="cpu", max_model_len=2048))
        self.config = self.inner.config
        self.model_config = model.config
        self.loads = [RankLoad(0, None), RankLoad(1, None)]

    def add_request(self, rid, prompt, params, **kwargs) -> int:
        self.inner.add_request(rid, prompt, params, **kwargs)
        load = min(self.loads, key=lambda r: r.requests)
        load.requests += 1
        load.tokens += len(prompt) + params.max_tokens
        return load.rank

    def step(self):
        return self.inner.step()

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def load_report(self):
        from tokenspeed.runtime.multirank import LoadReport

        return LoadReport(tuple(self.loads))

    def metrics(self) -> dict:
        return self.load_report().as_dict()


def test_a_multi_rank_replay_reports_per_rank_load_and_the_engines_hit_rate(tiny):
    """A multi-rank engine's metrics live in its workers: the replay counts its requests'
    outputs instead, per rank, as the engine counts them (the same prefix hit rate)."""
    sessions, block = agentx_sessions(4, 0, 1 / 128, 3)
    engine = _TwoRanksOfOneEngine(tiny)
    result = replay(engine, sessions, 3, block)
    ranks = result["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sum(r["requests"] for r in ranks) == result["requests"] > 2
    assert sum(r["generated_tokens"] for r in ranks) == result["generated_tokens"]
    assert [r["tokens"] for r in ranks] == [load.tokens for load in engine.loads]
    own = engine.inner.metrics.summary()
    assert own["prefix_hit_rate"] > 0
    for key in ("prefix_hit_rate", "ttft_mean_s", "ttft_p90_s", "p90_interactivity_tok_s"):
        assert result[key] == pytest.approx(own[key]), key
    report = engine.load_report()
    assert result["request_imbalance"] == report.request_imbalance
    assert result["token_imbalance"] == report.token_imbalance
    assert all(0 <= r["prefix_hit_rate"] <= 1 for r in ranks)


def test_replay_runs_over_worker_processes():
    """The real MultiRankEngine (two gloo workers on the CPU): the replay drives it through
    add_request / step, every turn finishes, and closing the engine stops its workers."""
    import multiprocessing
    import signal

    from tokenspeed.runtime import EngineConfig
    from tokenspeed.runtime.multirank import MultiRankEngine
    from tokenspeed.runtime.parallel_config import ParallelConfig

    def expire(signum, frame):
        raise TimeoutError("the multi-rank replay still runs after 90 s")

    before = set(multiprocessing.active_children())
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(90)
    try:
        sessions, block = agentx_sessions(3, 0, 1 / 128, 2)
        config = EngineConfig(device="cpu", max_model_len=2048, page_size=16)
        with MultiRankEngine("tiny", ParallelConfig(world_size=2), config) as engine:
            result = replay(engine, sessions, 3, block)
            assert not engine.has_unfinished()
            loads = engine.load_report().ranks
            placed = [load.requests for load in loads]
            assert [load.finished for load in loads] == placed  # every turn came back
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert set(multiprocessing.active_children()) <= before
    assert result["requests"] == sum(placed) > 0
    assert [r["requests"] for r in result["ranks"]] == placed
    assert result["skipped_turns"] == 0
    assert result["request_imbalance"] >= 1.0 and result["token_imbalance"] >= 1.0


def test_an_aiperf_dataset_replays_scaled_with_its_shared_prefixes(tiny, tmp_path):
    """`bench agentx --trace`: an aiperf dataset.jsonl (written as aiperf writes it) becomes
    sessions with token counts and the block size times the scale; shared block ids still hit."""
    from tokenspeed.runtime import Engine, EngineConfig
    from tokenspeed.runtime.agentx_replay import trace_sessions
    from tokenspeed.workload import AgentXWorkload, load_aiperf_dataset, write_aiperf_dataset
    from tokenspeed.workload.agentx import AgentXConfig

    path = write_aiperf_dataset(
        [AgentXWorkload(AgentXConfig(max_turns=3), seed=1).session(i) for i in range(3)],
        tmp_path / "dataset.jsonl",
    )
    full = load_aiperf_dataset(path)
    sessions, block = trace_sessions(path, 2, 1 / 128)
    assert block == 4 and [s.sid for s in sessions] == [s.sid for s in full.sessions[:2]]
    for ours, theirs in zip(sessions, full.sessions, strict=False):
        for a, b in zip(ours.turns, theirs.turns, strict=True):
            assert a.new_tokens == max(1, round(b.new_tokens / 128))
            assert a.output_tokens == max(1, round(b.output_tokens / 128))
            assert a.blocks == b.blocks
    engine = Engine(tiny, None, EngineConfig(device="cpu", max_model_len=2048, page_size=4))
    result = replay(engine, sessions, concurrency=2, block_size=block)
    assert result["requests"] + result["skipped_turns"] == sum(s.num_requests for s in sessions)
    assert result["requests"] > 0 and result["prefix_hit_rate"] > 0.3
    engine.check_integrity()


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read the aiperf dataset"), ("", "holds no session")],
)
def test_an_unreadable_or_empty_dataset_is_refused(tmp_path, content, message):
    from tokenspeed.runtime.agentx_replay import trace_sessions

    path = tmp_path / "dataset.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ReplayError, match=message):
        trace_sessions(path, 4, 1 / 128)
