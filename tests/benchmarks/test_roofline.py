"""benchmarks/roofline.py's arithmetic on a config small enough to count by hand and its parameter
counts against the real model's (CPU, no model forward)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.config import KdaConfig, MlaConfig, ModelConfig, MoeConfig

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
rf = importlib.util.module_from_spec(spec)
# Registered under the name the benchmarks import it by (dataclasses need it there too).
rf = sys.modules.setdefault("roofline", rf)
if not hasattr(rf, "roofline"):
    spec.loader.exec_module(rf)

# One KDA layer with a dense MLP, one MLA layer with a MoE of 4 experts (top 2, one shared).
CONFIG = ModelConfig(
    vocab_size=10,
    hidden_size=4,
    layer_kinds=("kda", "mla"),
    mlp_kinds=("dense", "moe"),
    dense_intermediate_size=6,
    kda=KdaConfig(num_heads=1, head_dim=2),  # conv kernel 4, low-rank gates
    mla=MlaConfig(
        num_heads=1, kv_lora_rank=2, qk_nope_head_dim=2, qk_rope_head_dim=1, v_head_dim=2
    ),
    moe=MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=3, num_shared_experts=1),
)


def test_param_counts_by_hand():
    p = rf.param_counts(CONFIG)
    # KDA (hidden 4, 1 head of 2, projections of 2): q, k, v 3*2*4 = 24; conv 6 channels x 4
    # = 24; f_a 2*4 = 8, f_b 2*2 = 4; A_log 1, dt_bias 2; b_proj 4; g_a 8 + g_b 4 = 12; o_norm 2;
    # o_proj 8: 89. MLA: q_proj 3*4 = 12; kv_a (2 + 1)*4 = 12; kv_a norm 2; kv_b (2 + 2)*2 = 8;
    # o_proj 8: 42.
    assert p.attention == 89 + 42
    assert p.norms == 2 * 2 * 4 + 4  # two norms per layer and the final one
    assert p.dense_mlp == 3 * 4 * 6
    assert (p.router, p.shared_experts, p.expert) == (4 * 4, 3 * 4 * 3, 3 * 4 * 3)
    assert (p.embedding, p.lm_head) == (40, 40)
    assert p.total == 40 + 40 + 131 + 20 + 72 + 16 + 36 + 4 * 36 == 499
    assert p.active_per_token == 131 + 72 + 16 + 36 + 2 * 36 == 327


@pytest.mark.parametrize("config", ["hand", "tiny", "kimi-linear-48b-a3b", "kimi-k3"])
def test_param_counts_match_the_model(config):
    """Every parameter of the model (built on the meta device: no memory) is counted once."""
    config = CONFIG if config == "hand" else get_preset(config)
    with torch.device("meta"):
        model = KimiForCausalLM(config)
    assert rf.param_counts(config).total == sum(p.numel() for p in model.parameters())


def test_distinct_experts():
    assert rf.distinct_experts(4, 2, 2) == pytest.approx(3.0)  # 4 * (1 - (1/2)^2)
    assert rf.distinct_experts(256, 8, 1) == pytest.approx(8.0)
    assert rf.distinct_experts(256, 8, 64) == pytest.approx(222.44, abs=0.01)  # ~87%
    assert rf.distinct_experts(256, 8, 0) == 0.0


def test_decode_bytes_by_hand():
    cache = rf.CacheBytes.of(CONFIG, dtype_bytes=2, recurrent_bytes=4)
    # MLA row (2 + 1) * 2 bytes; conv window 6 channels x 3 x 2 bytes; state 1 x 2 x 2 x 4 bytes
    assert cache == rf.CacheBytes(mla_row=6, kda_conv=36, kda_recurrent=16)
    parts = rf.decode_bytes(CONFIG, (5, 7), cache, weight_bytes=2)
    assert parts == {
        rf.EXPERTS_KEY: 1 * 3 * 36 * 2,  # 3 of 4 experts expected for 2 rows x top 2
        "shared experts": 36 * 2,
        "router + latent projections": 16 * 2,
        "attention / KDA weights": 131 * 2,
        "dense MLPs": 72 * 2,
        "norms": 20 * 2,
        "LM head": 40 * 2,
        "embedding rows": 2 * 4 * 2,
        "KDA states (read + write)": 2 * 2 * (36 + 16),  # 2 rows, 1 KDA layer
        "MLA cache rows (read c+1, write 1)": 6 * ((6 + 8) + 2),  # 1 MLA layer
    }
    assert sum(parts.values()) == 1166
    every = rf.decode_bytes(CONFIG, (5, 7), cache, weight_bytes=2, all_experts=True)
    assert every[rf.EXPERTS_KEY] == 4 * 36 * 2
    assert sum(every.values()) == 1166 + 36 * 2


def test_prefill_flops_by_hand():
    # Tokens 0..2 of one prompt (ends it: samples) and 2..3 of another: 5 tokens.
    parts = rf.prefill_flops(CONFIG, [(0, 3, True), (2, 4, False)])
    assert parts == {
        "weights (2 x active params per token)": 2 * 327 * 5,
        "LM head (sampling rows)": 2 * 10 * 4 * 1,
        # positions attended: 1 + 2 + 3 and 3 + 4 = 13; 1 head of qk 3 + v 2
        "MLA attention (causal)": 2 * 1 * (3 + 2) * 13,
        # per token and head 6*K*V + 2*C*(3K + 2V) = 24 + 2*64*10 = 1304
        "KDA chunked recurrence (ESTIMATE)": 1304 * 5,
    }
    assert sum(parts.values()) == 10_000


def test_roofline_seconds():
    schedule = [
        rf.PrefillForward(((0, 3, True), (2, 4, False))),
        rf.DecodeForward((5, 7)),
        rf.DecodeForward(()),  # an empty forward costs nothing and is not counted
        rf.DecodeForward((6, 8)),
    ]
    r = rf.roofline(CONFIG, schedule, copy_bandwidth=1166.0, matmul_rate=10_000.0)
    # Two decode forwards of 1166 bytes (the second reads 2 more MLA rows: 12 bytes).
    assert r.decode_s == pytest.approx((1166 + 1178) / 1166)
    assert r.prefill_s == pytest.approx(1.0)
    assert r.seconds == pytest.approx(r.decode_s + 1.0)
    assert (r.decode_forwards, r.decode_rows, r.prefill_steps, r.prefill_tokens) == (2, 4, 1, 5)
    assert r.prefill_weight_bytes == (499 - 40) * 2
