import statistics

import pytest

from tokenspeed.workload import AgentXConfig, AgentXWorkload, LogNormal

_GROUP_BASE = 1 << 32


@pytest.fixture(scope="module")
def sessions():
    gen = AgentXWorkload(seed=11)
    return [gen.session(i) for i in range(300)]


def test_same_seed_same_sessions_and_order_independent():
    a, b = AgentXWorkload(seed=5), AgentXWorkload(seed=5)
    assert [a.session(i) for i in range(5)] == [b.session(i) for i in range(5)]
    # Session i depends only on (seed, i), not on what was generated before.
    assert a.session(3) == AgentXWorkload(seed=5).session(3)
    assert AgentXWorkload(seed=6).session(3) != a.session(3)
    first = list(zip(range(4), AgentXWorkload(seed=5), strict=False))
    assert [s for _, s in first] == [a.session(i) for i in range(4)]


def test_defaults_follow_design_figures(sessions):
    cfg = AgentXConfig()
    later = [t for s in sessions for t in s.turns[1:]]
    new = [t.new_tokens for t in later]
    out = [t.output_tokens for s in sessions for t in s.turns]
    # Lognormal with mean 3500 / median 1800, and mean 500 / median 300 (sampling noise allowed).
    assert 1600 < statistics.median(new) < 2000 and 3000 < statistics.mean(new) < 4000
    assert 270 < statistics.median(out) < 330 and 450 < statistics.mean(out) < 550
    first = [s.turns[0].new_tokens for s in sessions]
    assert 58_000 < statistics.mean(first) < 68_000  # 32k + 20k shared + ~10k own
    agentic = sum(t.delay_s < 10 for t in later) / len(later)
    assert 0.6 < agentic < 0.85  # 70% agentic (~2.5 s) and 30% human (~40 s) delays
    # No prompt reaches the cap.
    for s in sessions:
        context = 0
        for t in s.turns:
            context += t.new_tokens
            assert context < cfg.max_prompt_tokens
            context += t.output_tokens


def test_prefixes_shared_globally_and_within_groups(sessions):
    cfg = AgentXConfig()
    shared = cfg.whole_blocks(cfg.shared_prefix_tokens)
    group = cfg.whole_blocks(cfg.group_prefix_tokens)
    heads = {s.turns[0].blocks[:shared] for s in sessions}
    assert len(heads) == 1  # one system prompt for all
    by_group = {}
    for s in sessions:
        by_group.setdefault(s.group, set()).add(s.turns[0].blocks[shared : shared + group])
    assert all(len(v) == 1 for v in by_group.values())
    assert len(by_group) > 10
    # Zipf: the most popular group is much more common than the median one.
    counts = sorted((sum(s.group == g for s in sessions) for g in by_group), reverse=True)
    assert counts[0] > 3 * counts[len(counts) // 2]
    # Everything after the prefixes is unique to the session.
    own = [b for s in sessions for t in s.turns for b in t.blocks if b >= 1 << 40]
    assert len(own) == len(set(own))


def test_block_ids_describe_the_new_tokens(sessions):
    for s in sessions[:50]:
        for t in s.turns:
            assert len(t.blocks) == -(-t.new_tokens // 512)


def test_subagent_bursts_start_from_fresh_context(sessions):
    cfg = AgentXConfig()
    shared = cfg.whole_blocks(cfg.shared_prefix_tokens)
    bursts = [t.subagents for s in sessions for t in s.turns if t.subagents]
    assert bursts, "the default stream has subagent bursts"
    assert all(cfg.subagents_per_burst[0] <= len(b) <= cfg.subagents_per_burst[1] for b in bursts)
    for burst in bursts:
        for sub in burst:
            assert sub.kind == "subagent"
            first = sub.turns[0]
            # Fresh context: the shared system prefix, then its own task (no parent history).
            assert first.blocks[:shared] == tuple(range(shared))
            assert all(b >= 1 << 40 for b in first.blocks[shared:])
            assert all(t.delay_s < 60 for t in sub.turns)  # agentic delays only
    # Without the group prefix and a long own context, subagent contexts are much shorter.
    sub_first = [sub.turns[0].new_tokens for b in bursts for sub in b]
    main_first = [s.turns[0].new_tokens for s in sessions]
    assert statistics.median(sub_first) < statistics.median(main_first) - 15_000


def test_config_rejects_impossible_values():
    with pytest.raises(ValueError, match="agentic_fraction"):
        AgentXConfig(agentic_fraction=1.5)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        AgentXConfig(max_prompt_tokens=40_000)
    with pytest.raises(ValueError, match="subagents_per_burst"):
        AgentXConfig(subagents_per_burst=(3, 1))
    with pytest.raises(ValueError, match="mean > median"):
        LogNormal(100, 200)


def test_take_and_max_turns():
    w = AgentXWorkload(AgentXConfig(max_turns=3, subagent_probability=0.0), seed=1).take(20)
    assert len(w) == 20 and all(len(s.turns) <= 3 for s in w)
    assert not any(t.subagents for s in w for t in s.turns)


def _prompts(session):
    """Every prompt the session issues, its subagents' included."""
    context = 0
    for t in session.turns:
        context += t.new_tokens
        yield context
        context += t.output_tokens
        for sub in t.subagents:
            yield from _prompts(sub)


def test_no_prompt_reaches_the_cap_not_even_a_first_turn():
    """Sampled first contexts (sessions' and subagents') far past the cap are cut to fit: the
    session ends when its prompt would reach the cap, so its first prompt must stay under it."""
    cfg = AgentXConfig(
        shared_prefix_tokens=1000,
        group_prefix_tokens=512,
        max_prompt_tokens=12_000,
        subagent_probability=1.0,
    )
    gen = AgentXWorkload(cfg, seed=0)
    sessions = [gen.session(i) for i in range(100)]
    prompts = [p for s in sessions for p in _prompts(s)]
    assert max(prompts) == cfg.max_prompt_tokens - 1  # the cut leaves the longest prompt that fits
    assert all(p < cfg.max_prompt_tokens for p in prompts)
    assert any(t.subagents for s in sessions for t in s.turns)
    assert sessions == [AgentXWorkload(cfg, seed=0).session(i) for i in range(100)]
    # The default stream has such sessions too: seed 7's session 748 sampled a 264k first prompt.
    assert max(_prompts(AgentXWorkload(seed=7).session(748))) < AgentXConfig().max_prompt_tokens


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("subagent_turns_mean", 0.5),  # a geometric number of turns has a mean >= 1
        ("num_groups", 2.5),
        ("num_groups", True),
        ("block_size", 1.5),
        ("max_turns", 1.5),
        ("subagents_per_burst", (1.5, 2)),
        ("group_zipf_alpha", float("inf")),
        ("shared_prefix_tokens", 0.5),
    ],
)
def test_config_rejects_values_that_would_fail_while_generating(field, value):
    with pytest.raises(ValueError, match=field):
        AgentXConfig(**{field: value})


def test_seed_is_a_non_negative_integer():
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        AgentXWorkload(seed=-1)
    with pytest.raises(ValueError, match="seed"):
        AgentXWorkload(seed=1.5)
    with pytest.raises(ValueError, match="finite mean"):
        LogNormal(float("inf"), 10)


_TOKEN_FIELDS = ("session_context", "new_tokens", "output_tokens", "subagent_context")


@pytest.mark.parametrize("field", _TOKEN_FIELDS)
@pytest.mark.parametrize("low", [0, 0.5])
def test_token_count_distributions_need_low_of_one_token(field, low):
    # LogNormal(3, 1) draws below half a token about a third of the time: with low=0 a turn of
    # zero tokens would come out (and fail in `Turn`) deep into generation.
    with pytest.raises(ValueError, match=f"{field} is a token count: .* needs low >= 1"):
        AgentXConfig(**{field: LogNormal(3, 1, low=low)})


def test_low_token_counts_clip_to_one_token():
    small = LogNormal(3, 1)
    cfg = AgentXConfig(new_tokens=small, output_tokens=small, subagent_probability=0.0)
    turns = [t for i in range(50) for t in AgentXWorkload(cfg, seed=0).session(i).turns]
    assert min(t.output_tokens for t in turns) == 1
    assert min(t.new_tokens for t in turns[1:]) >= 1


@pytest.mark.parametrize("field", [*_TOKEN_FIELDS, "agentic_delay_s", "human_delay_s"])
def test_distribution_fields_must_be_lognormals(field):
    with pytest.raises(ValueError, match=f"{field} must be a LogNormal"):
        AgentXConfig(**{field: 300})


def test_delays_may_clip_below_one():
    cfg = AgentXConfig(agentic_delay_s=LogNormal(2.5, 1.8, low=0))
    assert cfg.agentic_delay_s.low == 0


@pytest.mark.parametrize(
    "field",
    [
        "agentic_fraction",
        "reset_probability",
        "subagent_probability",
        "group_zipf_alpha",
        "reset_context_scaling",
        "subagent_turns_mean",
    ],
)
@pytest.mark.parametrize("value", [True, "0.5", None])
def test_real_valued_fields_reject_bools_and_non_numbers(field, value):
    """True used to pass as 1.0 (a probability of one, say), and a string escaped as a
    TypeError from the comparison instead of a message naming the field."""
    with pytest.raises(ValueError, match=field):
        AgentXConfig(**{field: value})


@pytest.mark.parametrize(("mean", "median"), [(True, 0.5), (2, True), ("3", 1), (3, None)])
def test_lognormal_mean_and_median_must_be_numbers(mean, median):
    with pytest.raises(ValueError, match="lognormal needs finite mean > median > 0"):
        LogNormal(mean, median)
