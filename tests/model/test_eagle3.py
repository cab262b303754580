"""The EAGLE3 drafter: config and checkpoint round trips, the vocabulary map, refused checkpoints,
its attention against a dense reference (transformers' Llama rotary), its paged KV and the
drafting chain."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.batch import BatchError
from tokenspeed.model.config import ConfigError
from tokenspeed.model.eagle3 import (
    Eagle3Config,
    Eagle3Drafter,
    PagedDraftKv,
    RopeScaling,
    default_aux_layers,
)
from tokenspeed.model.eagle3_loader import (
    eagle3_config_from_hf,
    eagle3_to_hf_config,
    load_eagle3,
)
from tokenspeed.model.eagle3_writer import WEIGHTS_FILE, init_random_eagle3, save_eagle3
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.loader import CheckpointError

VOCAB, HIDDEN = 512, 64


def config(**changes) -> Eagle3Config:
    base = Eagle3Config(
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        draft_vocab_size=128,
        target_hidden_size=HIDDEN,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
    )
    return base.evolve(**changes)


@pytest.fixture(scope="module")
def target():
    return init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=4).eval()


@pytest.fixture(scope="module")
def drafter():
    return init_random_eagle3(Eagle3Drafter(config()), seed=7).eval()


def _run(drafter, n=12, seed=0, kv=None):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n,), generator=gen)
    aux = torch.randn(n, drafter.fc.in_features, generator=gen)
    kv = kv or PagedDraftKv.contiguous(drafter.config, 1, 64)
    return drafter.extend(ids, aux, ForwardBatch.build([n]), kv)


# ----------------------------------------------------------------------------- config


def test_config_round_trips_through_config_json():
    for cfg in (
        config(),
        config(
            rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0),
            aux_layer_ids=(1, 4, 6),
            norm_before_residual=True,
            num_kv_heads=4,
        ),
        config(rope_scaling=RopeScaling(rope_type="linear", factor=2.0)),
    ):
        assert eagle3_config_from_hf(json.loads(json.dumps(eagle3_to_hf_config(cfg)))) == cfg


def test_config_reads_the_shipped_spellings():
    raw = {
        "architectures": ["Eagle3LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "vocab_size": 512,
        "draft_vocab_size": 100,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
    }
    cfg = eagle3_config_from_hf(raw)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == (16, 1, 1e6)
    assert cfg.target_hidden_size == 64 and cfg.aux_layer_ids == (1, 3, 5)
    # Layer outputs 1, 3, 5 are the inputs of layers 2, 4, 6.
    assert cfg.capture_points(9) == (2, 4, 6)
    assert config().capture_points(9) == default_aux_layers(9) == (2, 4, 6)
    assert default_aux_layers(61) == (2, 30, 58)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE3 drafter"),
        ({"num_hidden_layers": 2}, "one decoder layer"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"draft_vocab_size": 1000}, "exceeds vocab_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, "distinct"),
        ({"hidden_size": None}, "lacks hidden_size"),
    ],
)
def test_bad_configs_are_refused_by_name(change, words):
    raw = eagle3_to_hf_config(config())
    raw.update(change)
    with pytest.raises(ConfigError, match=words):
        eagle3_config_from_hf(raw)


def test_capture_points_past_the_target_are_refused():
    with pytest.raises(ConfigError, match="past the target"):
        config(aux_layer_ids=(1, 4, 9)).capture_points(9)


# ------------------------------------------------------------------ vocabulary map


def test_d2t_and_t2d_round_trip(tmp_path):
    d = Eagle3Drafter(config())
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:128]
    init_random_eagle3(d, seed=2, target_ids=ids)  # unsorted on purpose
    assert torch.equal(d.to_target(torch.arange(128)), ids)
    assert torch.equal(d.d2t, ids - torch.arange(128))
    assert d.t2d.sum() == 128 and bool(d.t2d[ids].all())
    probs = torch.softmax(torch.randn(3, 128), -1)
    mapped = d.to_target_probs(probs)
    assert mapped.shape == (3, VOCAB)
    assert torch.equal(mapped[:, ids], probs) and torch.equal(
        mapped[:, ~d.t2d], torch.zeros(3, 384)
    )
    save_eagle3(d, tmp_path)
    loaded = load_eagle3(tmp_path)
    assert torch.equal(loaded.d2t, d.d2t) and torch.equal(loaded.t2d, d.t2d)
    assert loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool
    with pytest.raises(ValueError, match="two draft ids"):
        d.set_vocab(torch.zeros(128, dtype=torch.int64))


def test_a_full_draft_vocabulary_may_leave_out_the_map(tmp_path):
    d = init_random_eagle3(Eagle3Drafter(config(draft_vocab_size=VOCAB)), seed=3)
    save_eagle3(d, tmp_path)
    tensors = load_file(tmp_path / WEIGHTS_FILE)
    del tensors["d2t"], tensors["t2d"]
    save_file(tensors, tmp_path / WEIGHTS_FILE)
    loaded = load_eagle3(tmp_path)
    assert torch.equal(loaded.to_target(torch.arange(VOCAB)), torch.arange(VOCAB))
    assert bool(loaded.t2d.all())


# --------------------------------------------------------------------- checkpoints


def test_drafter_loads_from_its_hf_layout_and_runs(drafter, target, tmp_path):
    save_eagle3(drafter, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 128
    names = set(load_file(tmp_path / WEIGHTS_FILE))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight"} <= names
    assert {"midlayer.mlp.down_proj.weight", "lm_head.weight", "d2t", "t2d"} <= names
    loaded = load_eagle3(tmp_path, target=target)
    assert loaded.config == drafter.config and not loaded.shares_embedding
    for (name, a), (_, b) in zip(
        drafter.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    want, got = _run(drafter), _run(loaded)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.hidden, want.hidden)
    assert got.logits.shape == (12, 128) and got.hidden.shape == (12, HIDDEN)
    half = load_eagle3(tmp_path, dtype="bfloat16")
    assert half.fc.weight.dtype == torch.bfloat16 and half.d2t.dtype == torch.int64


def test_a_checkpoint_without_embedding_shares_the_targets(drafter, target, tmp_path):
    save_eagle3(drafter, tmp_path, include_embedding=False)
    assert "embed_tokens.weight" not in load_file(tmp_path / WEIGHTS_FILE)
    loaded = load_eagle3(tmp_path, target=target)
    assert loaded.shares_embedding
    assert loaded.embed_tokens is target.model.embed_tokens
    with pytest.raises(CheckpointError, match="pass the target model"):
        load_eagle3(tmp_path)
    # Saving a sharing drafter leaves the target's embedding out by default.
    save_eagle3(loaded, tmp_path / "again")
    assert "embed_tokens.weight" not in load_file(tmp_path / "again" / WEIGHTS_FILE)


def _edit(tmp_path, drafter, change=None, config_change=None):
    save_eagle3(drafter, tmp_path)
    if change is not None:
        tensors = load_file(tmp_path / WEIGHTS_FILE)
        change(tensors)
        save_file(tensors, tmp_path / WEIGHTS_FILE)
    if config_change is not None:
        raw = json.loads((tmp_path / "config.json").read_text())
        raw.update(config_change)
        (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (_drop("midlayer.self_attn.k_proj.weight"), "missing tensors"),
        (_drop("lm_head.weight"), "lm_head.weight"),
        (_drop("d2t"), "d2t"),
        (_set("fc.weight", torch.zeros(64, 128)), r"fc.weight: shape \[64, 128\], expected"),
        (_set("midlayer.q_proj.weight", torch.zeros(2)), "unexpected tensors"),
        (_set("d2t", torch.zeros(128)), "d2t: dtype float32"),
        (_set("t2d", torch.full((VOCAB,), 2, dtype=torch.int64)), "t2d"),
        (_set("d2t", torch.full((128,), VOCAB, dtype=torch.int64)), "outside"),
        (_set("t2d", torch.ones(VOCAB, dtype=torch.bool)), "do not describe one"),
        (_set("norm.weight", torch.zeros(HIDDEN, dtype=torch.int32)), "floating-point"),
    ],
)
def test_malformed_checkpoints_are_refused_by_name(drafter, tmp_path, change, words):
    path = _edit(tmp_path, drafter, change)
    with pytest.raises(CheckpointError, match=words):
        load_eagle3(path)


def test_every_problem_is_reported_at_once(drafter, tmp_path):
    def change(t):
        t.pop("norm.weight")
        t["fc.weight"] = torch.zeros(1, 1)
        t["extra"] = torch.zeros(1)

    with pytest.raises(CheckpointError) as err:
        load_eagle3(_edit(tmp_path, drafter, change))
    assert err.value.missing == ["norm.weight"] and err.value.unexpected == ["extra"]
    assert len(err.value.mis_shaped) == 1


def test_model_prefix_and_non_strict_loading(drafter, tmp_path):
    def prefixed(t):
        for name in list(t):
            t[f"model.{name}"] = t.pop(name)
        t["model.extra"] = torch.zeros(1)

    path = _edit(tmp_path, drafter, prefixed)
    with pytest.raises(CheckpointError, match="extra"):
        load_eagle3(path)
    loaded = load_eagle3(path, strict=False)
    assert torch.equal(loaded.lm_head.weight, drafter.lm_head.weight)


@pytest.mark.parametrize(
    ("config_change", "words"),
    [
        ({"vocab_size": 1024}, "another tokenizer"),
        ({"target_hidden_size": 32}, "target_hidden_size"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 9]}}, "past the target"),
    ],
)
def test_a_drafter_for_another_target_is_refused(drafter, target, tmp_path, config_change, words):
    path = _edit(tmp_path, drafter, config_change=config_change)
    with pytest.raises(CheckpointError, match=words):
        load_eagle3(path, target=target)


def test_not_an_eagle3_directory(tmp_path, drafter):
    with pytest.raises(ConfigError, match="no config.json"):
        load_eagle3(tmp_path)
    path = _edit(tmp_path, drafter)
    (path / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_eagle3(path)


# ------------------------------------------------------------------- the forward


def _dense_reference(d: Eagle3Drafter, ids, aux, positions):
    """One sequence, all rows at once, written independently: transformers' Llama rotary and
    apply_rotary_pos_emb, GQA by repeating kv heads, a causal mask."""
    c = d.config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope = {
            "rope_type": s.rope_type,
            "rope_theta": c.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    hf = LlamaConfig(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        head_dim=c.head_dim,
        rope_parameters=rope,
        max_position_embeddings=4096,
    )
    m = d.midlayer
    a = m.self_attn
    h = d.fc(aux)
    x = torch.cat([m.input_layernorm(d.embed_tokens(ids)), m.hidden_norm(h)], -1)
    n = ids.numel()
    q = a.q_proj(x).view(1, n, c.num_heads, c.head_dim).transpose(1, 2)
    k = a.k_proj(x).view(1, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
    v = a.v_proj(x).view(1, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(hf)(v, positions.unsqueeze(0))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    group = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / c.head_dim**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, -1)
    r = h + a.o_proj(o)
    out = r + m.mlp(m.post_attention_layernorm(r))
    return d.lm_head(d.norm(out)), out


@pytest.mark.parametrize(
    "scaling",
    [None, RopeScaling(rope_type="llama3", factor=8.0, original_max_position_embeddings=64)],
)
def test_forward_matches_a_dense_llama_reference(scaling):
    d = init_random_eagle3(Eagle3Drafter(config(rope_scaling=scaling)), seed=5).eval()
    n = 20
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (n,), generator=gen)
    aux = torch.randn(n, 3 * HIDDEN, generator=gen)
    got = d.extend(ids, aux, ForwardBatch.build([n]), PagedDraftKv.contiguous(d.config, 1, n))
    with torch.no_grad():
        logits, hidden = _dense_reference(d, ids, aux, torch.arange(n))
    torch.testing.assert_close(got.hidden, hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logits, logits, rtol=1e-5, atol=1e-5)


def test_paged_kv_and_steps_compute_what_one_contiguous_pass_does(drafter):
    """Two requests, page size 4 over a shuffled page table, extended in two steps, equal each
    request's rows computed alone in one pass; padding pages stay untouched."""
    gen = torch.Generator().manual_seed(9)
    lens = [13, 6]
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lens]
    aux = [torch.randn(n, 3 * HIDDEN, generator=gen) for n in lens]
    alone = [_dense_one(drafter, i, a) for i, a in zip(ids, aux, strict=True)]
    k, v = PagedDraftKv.pool(drafter.config, 12, 4)
    table = torch.tensor([[7, 2, 9, 4], [3, 11, 0, 0]])
    kv = PagedDraftKv(k, v, table)
    first = [8, 2]
    step1 = drafter.extend(
        torch.cat([i[:f] for i, f in zip(ids, first, strict=True)]),
        torch.cat([a[:f] for a, f in zip(aux, first, strict=True)]),
        ForwardBatch.build(first),
        kv,
    )
    rest = [n - f for n, f in zip(lens, first, strict=True)]
    step2 = drafter.extend(
        torch.cat([i[f:] for i, f in zip(ids, first, strict=True)]),
        torch.cat([a[f:] for a, f in zip(aux, first, strict=True)]),
        ForwardBatch.build(rest, first),
        kv,
    )
    got0 = torch.cat([step1.hidden[:8], step2.hidden[:5]])
    got1 = torch.cat([step1.hidden[8:], step2.hidden[5:]])
    torch.testing.assert_close(got0, alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got1, alone[1], rtol=1e-5, atol=1e-5)
    untouched = [p for p in range(12) if p not in (7, 2, 9, 4, 3, 11, 0)]
    assert not k[untouched].any() and not v[untouched].any()


def _dense_one(drafter, ids, aux):
    return drafter.extend(
        ids, aux, ForwardBatch.build([ids.numel()]), PagedDraftKv.contiguous(drafter.config, 1, 32)
    ).hidden


def test_forward_refuses_inconsistent_inputs(drafter):
    kv = PagedDraftKv.contiguous(drafter.config, 1, 8)
    batch = ForwardBatch.build([4])
    ids = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(BatchError, match="fc reads 192"):
        drafter.extend(ids, torch.zeros(4, 64), batch, kv)
    with pytest.raises(BatchError, match="hidden has shape"):
        drafter(ids, torch.zeros(4, 192), batch, kv)
    with pytest.raises(BatchError, match="reaches 12"):
        drafter.extend(ids, torch.zeros(4, 192), ForwardBatch.build([4], [8]), kv)
    with pytest.raises(BatchError, match="one row per request"):
        drafter.extend(ids, torch.zeros(4, 192), ForwardBatch.build([2, 2]), kv)


def test_norm_before_residual_changes_the_residual_only():
    plain = init_random_eagle3(Eagle3Drafter(config()), seed=6)
    other = init_random_eagle3(Eagle3Drafter(config(norm_before_residual=True)), seed=6)
    assert not torch.allclose(_run(plain).hidden, _run(other).hidden)


# ---------------------------------------------------------------- drafting chain


def test_greedy_proposal_is_the_step_by_step_chain(drafter):
    gen = torch.Generator().manual_seed(4)
    lens, steps = [5, 3], 4
    ids = torch.randint(0, VOCAB, (sum(lens),), generator=gen)
    aux = torch.randn(sum(lens), 3 * HIDDEN, generator=gen)
    kv = PagedDraftKv.contiguous(drafter.config, 2, 16)
    got = drafter.propose(ids, aux, ForwardBatch.build(lens), kv, steps)
    assert got.tokens.shape == (2, steps) and got.probs is None
    assert bool(drafter.t2d[got.tokens].all())  # target ids inside the draft vocabulary
    for row, (start, n) in enumerate([(0, 5), (5, 3)]):
        kv1 = PagedDraftKv.contiguous(drafter.config, 1, 16)
        out = drafter.extend(
            ids[start : start + n], aux[start : start + n], ForwardBatch.build([n]), kv1
        )
        hidden, chain = out.hidden[-1:], [int(drafter.to_target(out.logits[-1].argmax()))]
        for s in range(1, steps):
            out = drafter(
                torch.tensor(chain[-1:]), hidden, ForwardBatch.build([1], [n + s - 1]), kv1
            )
            hidden = out.hidden
            chain.append(int(drafter.to_target(out.logits[0].argmax())))
        assert got.tokens[row].tolist() == chain


def test_sampled_proposal_is_seeded_and_reports_its_distributions(drafter):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (6,), generator=gen)
    aux = torch.randn(6, 3 * HIDDEN, generator=gen)

    def propose(seed):
        kv = PagedDraftKv.contiguous(drafter.config, 2, 16)
        gens = [None, torch.Generator().manual_seed(seed)]
        return drafter.propose(ids, aux, ForwardBatch.build([3, 3]), kv, 3, [0.0, 1.5], gens)

    a, b = propose(11), propose(11)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.probs, b.probs)
    assert a.probs.shape == (2, 3, 128)
    torch.testing.assert_close(a.probs.sum(-1), torch.ones(2, 3))
    # The greedy row's distributions are point masses at its tokens.
    greedy = drafter.to_target(a.probs[0].argmax(-1))
    assert torch.equal(greedy, a.tokens[0]) and bool((a.probs[0].max(-1).values == 1).all())
    target = drafter.to_target_probs(a.probs[1])
    assert bool((target.gather(1, a.tokens[1].unsqueeze(1)) > 0).all())
