"""K3-only parts, each against its formula computed independently inside the test."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.model import ForwardBatch, KimiForCausalLM, get_preset
from tokenspeed.model.config import ActivationConfig, KdaConfig, MlaConfig, MoeConfig
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.kda import KdaAttention
from tokenspeed.model.layers.mla import GatedMla
from tokenspeed.model.layers.mlp import GluMlp
from tokenspeed.model.layers.moe import MoE, Mxfp4Experts, expert_format
from tokenspeed.model.ops.activation import situ_glu
from tokenspeed.model.state import KdaState

TOL = 1e-5


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5)
            if "norm" in name:
                p.add_(1.0)
        for _, b in module.named_buffers():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def test_attn_res_blocks_and_final_mix():
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=1)
    cfg = model.config
    block = cfg.attn_res_block_size
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    batch = ForwardBatch.build([12])
    state = model.empty_state()

    def mix(entries, site):
        v = torch.stack(entries)  # [N, T, D]
        w = site.norm.weight * site.proj.weight[0]
        score = (v / torch.sqrt((v * v).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w).sum(-1)
        alpha = torch.softmax(score, dim=0)
        return (alpha[..., None] * v).sum(0)

    # Block n collects the sub-layer outputs of layers n*B .. n*B+B-1; the bank seen by layer l
    # is [embedding, every completed block sum] plus the running sum of l's own block.
    with torch.no_grad():
        emb = model.model.embed_tokens(ids)
        outputs = []  # sum of both sub-layer outputs of each layer
        for layer in model.model.layers:
            i = layer.index
            first = (i // block) * block
            done = [emb] + [sum(outputs[b * block : (b + 1) * block]) for b in range(i // block)]
            running = sum(outputs[first:i]) if i > first else None
            x = mix(done + ([running] if running is not None else []), layer.self_attention_res)
            sub_state = state.kda[i] if layer.kind == "kda" else state.mla[i]
            attn, _ = layer.self_attn(layer.input_layernorm(x), batch, sub_state)
            running = attn if running is None else running + attn
            x = mix([*done, running], layer.mlp_res)
            outputs.append(attn + layer.mlp(layer.post_attention_layernorm(x)))
        n = cfg.num_layers
        last = (n - 1) // block
        done = [emb] + [sum(outputs[b * block : (b + 1) * block]) for b in range(last)]
        final = mix([*done, sum(outputs[last * block :])], model.model.output_attn_res)
        expected = model.lm_head(model.model.norm(final))
    got = model(ids, batch, state).logits
    assert (got - expected).abs().max() <= 1e-4
    assert len(done) == 3  # embedding + two completed blocks of 4 in a 9-layer model


def _expected_moe(moe: MoE, cfg: MoeConfig, act, x):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = torch.sigmoid(moe.gate.weight @ x[t])
        biased = (s + moe.gate.e_score_correction_bias).tolist()
        chosen = sorted(range(cfg.num_experts), key=lambda e: (-biased[e], e))[: cfg.top_k]
        w = s[chosen] / s[chosen].sum() * cfg.routed_scaling_factor
        h = moe.routed_expert_down_proj.weight @ x[t]
        y = torch.zeros_like(h)
        for weight, e in zip(w, chosen, strict=True):
            gate = moe.experts.w1[e] @ h
            up = moe.experts.w3[e] @ h
            a = act.situ_beta * torch.tanh(gate / act.situ_beta) * torch.sigmoid(gate)
            u = act.situ_linear_beta * torch.tanh(up / act.situ_linear_beta)
            y = y + weight * (moe.experts.w2[e] @ (a * u))
        y = _rms(y, moe.routed_expert_norm.weight, moe.routed_expert_norm.eps)
        y = moe.routed_expert_up_proj.weight @ y
        sh = moe.shared_experts
        g, u = sh.gate_proj.weight @ x[t], sh.up_proj.weight @ x[t]
        a = act.situ_beta * torch.tanh(g / act.situ_beta) * torch.sigmoid(g)
        u = act.situ_linear_beta * torch.tanh(u / act.situ_linear_beta)
        out[t] = y + sh.down_proj.weight @ (a * u)
    return out


def test_latent_moe_with_latent_norm():
    cfg = MoeConfig(
        num_experts=12,
        top_k=3,
        expert_intermediate_size=20,
        num_shared_experts=2,
        latent_size=16,
        latent_norm=True,
        routed_scaling_factor=1.5,
    )
    act = ActivationConfig(kind="situ", situ_beta=4.0, situ_linear_beta=25.0)
    moe = MoE(40, cfg, act, eps=1e-5)
    _randomize(moe, 0)
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        assert (moe(x) - _expected_moe(moe, cfg, act, x)).abs().max() <= TOL
        # The latent norm is really applied: scaling its weight changes the output.
        moe.routed_expert_norm.weight.mul_(2.0)
        assert (moe(x) - _expected_moe(moe, cfg, act, x)).abs().max() <= TOL


def test_latent_moe_with_mxfp4_experts():
    cfg = MoeConfig(
        num_experts=12,
        top_k=3,
        expert_intermediate_size=32,
        num_shared_experts=1,
        latent_size=32,
        latent_norm=True,
    )
    act = ActivationConfig(kind="situ", situ_beta=4.0, situ_linear_beta=25.0)
    moe = MoE(40, cfg, act, eps=1e-5)
    _randomize(moe, 0)
    dense = copy.deepcopy(moe)
    moe.experts = Mxfp4Experts.quantize(moe.experts)
    assert moe.experts.w1_packed.dtype == torch.uint8
    for name, w in zip(("w1", "w2", "w3"), moe.experts.decoded(torch.float32), strict=True):
        assert not torch.equal(getattr(dense.experts, name), w)  # rounded to MXFP4
        getattr(dense.experts, name).data.copy_(w)
    x = torch.randn(9, 40, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        assert (moe(x) - _expected_moe(dense, cfg, act, x)).abs().max() <= TOL
    # The Triton path gets the packed buffers themselves (no copies, no upcast).
    _, kernel = moe._kernel_weights()
    assert kernel.format == "mxfp4"
    assert kernel.w2.data_ptr() == moe.experts.w2_packed.data_ptr()
    assert kernel.s3.data_ptr() == moe.experts.w3_scale.data_ptr()
    assert expert_format(moe) == "mxfp4" and expert_format(dense) == "dense"
    mixed = torch.nn.ModuleList([moe, dense])
    with pytest.raises(ValueError, match="mix dense and MXFP4"):
        expert_format(mixed)
    with pytest.raises(ValueError, match="multiples of 32"):
        Mxfp4Experts(4, 40, 32, act)


def _mla_reference(layer: GatedMla, x):
    """One sequence, causal, from scratch: q LoRA, expanded keys, output gate."""
    c = layer.config
    qa = x @ layer.q_a_proj.weight.T
    qa = _rms(qa, layer.q_a_layernorm.weight, 1e-6)
    q = (qa @ layer.q_b_proj.weight.T).view(len(x), c.num_heads, c.qk_head_dim)
    comp = x @ layer.kv_a_proj_with_mqa.weight.T
    latent = _rms(comp[:, : c.kv_lora_rank], layer.kv_a_layernorm.weight, 1e-6)
    k_rope = comp[:, c.kv_lora_rank :]
    kv = (latent @ layer.kv_b_proj.weight.T).view(len(x), c.num_heads, -1)
    k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim :]
    out = torch.zeros(len(x), c.num_heads, c.v_head_dim)
    for t in range(len(x)):
        for h in range(c.num_heads):
            k = torch.cat([k_nope[: t + 1, h], k_rope[: t + 1]], -1)
            p = torch.softmax(k @ q[t, h] / math.sqrt(c.qk_head_dim), 0)
            out[t, h] = p @ v[: t + 1, h]
    gate = torch.sigmoid(x @ layer.g_proj.weight.T)
    return (out.reshape(len(x), -1) * gate) @ layer.o_proj.weight.T


@pytest.mark.parametrize("n", [1, 3, 17])
def test_mla_output_gate(n):
    cfg = MlaConfig(
        num_heads=3,
        q_lora_rank=12,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        output_gate=True,
    )
    layer = GatedMla(24, cfg)
    _randomize(layer, 2)
    x = torch.randn(n, 24, generator=torch.Generator().manual_seed(3))
    empty = [torch.zeros(0, cfg.latent_width)]
    with torch.no_grad():
        got, rows = layer(x, ForwardBatch.build([n]), empty)
        assert (got - _mla_reference(layer, x)).abs().max() <= TOL
    assert rows[0].shape == (n, cfg.latent_width)


def _kda_reference(layer: KdaAttention, x):
    """One sequence, token by token, straight from the K3 description."""
    c = layer.config
    heads, dim, width = c.num_heads, c.head_dim, c.conv_kernel
    qkv = torch.cat(
        [x @ layer.q_proj.weight.T, x @ layer.k_proj.weight.T, x @ layer.v_proj.weight.T], -1
    )
    padded = torch.cat([torch.zeros(width - 1, qkv.shape[1]), qkv])
    conv = torch.stack(
        [(padded[t : t + width].T * layer.conv_weight).sum(-1) for t in range(len(x))]
    )
    conv = conv * torch.sigmoid(conv)
    q, k, v = (z.view(len(x), heads, dim) for z in conv.split(heads * dim, -1))
    f = (x @ layer.f_a_proj.weight.T @ layer.f_b_proj.weight.T).view(len(x), heads, dim)
    pre = f + layer.dt_bias.view(heads, dim)
    rate = layer.A_log.exp()[:, None]
    if c.gate == "lower_bound":
        g = c.gate_lower_bound * torch.sigmoid(rate * pre)
    else:
        g = -rate * torch.log1p(torch.exp(pre))
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    if c.full_rank_output_gate:
        gate = (x @ layer.g_proj.weight.T).view(len(x), heads, dim)
    else:
        gate = (x @ layer.g_a_proj.weight.T @ layer.g_b_proj.weight.T).view(len(x), heads, dim)
    s = torch.zeros(heads, dim, dim)
    out = torch.zeros(len(x), heads, dim)
    for t in range(len(x)):
        for h in range(heads):
            qt = q[t, h] / torch.sqrt((q[t, h] ** 2).sum() + 1e-6) / math.sqrt(dim)
            kt = k[t, h] / torch.sqrt((k[t, h] ** 2).sum() + 1e-6)
            s[h] = torch.exp(g[t, h])[:, None] * s[h]
            s[h] = s[h] + beta[t, h] * torch.outer(kt, v[t, h] - s[h].T @ kt)
            o = s[h].T @ qt
            o = _rms(o, layer.o_norm.weight, layer.o_norm.eps) * torch.sigmoid(gate[t, h])
            out[t, h] = o
    return out.reshape(len(x), -1) @ layer.o_proj.weight.T, s


@pytest.mark.parametrize(
    "gate,full_rank", [("lower_bound", True), ("softplus", False), ("lower_bound", False)]
)
def test_kda_gate_forms_and_output_gates(gate, full_rank):
    cfg = KdaConfig(num_heads=2, head_dim=8, gate=gate, full_rank_output_gate=full_rank)
    layer = KdaAttention(20, cfg, eps=1e-5)
    _randomize(layer, 4)
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([0.3, 1.2]))
        layer.dt_bias.normal_(generator=torch.Generator().manual_seed(5))
    x = torch.randn(70, 20, generator=torch.Generator().manual_seed(6))
    state = KdaState(torch.zeros(1, cfg.conv_channels, 3), torch.zeros(1, 2, 8, 8))
    with torch.no_grad():
        got, new = layer(x, ForwardBatch.build([70]), state)
        want, s = _kda_reference(layer, x)
    assert (got - want).abs().max() <= 1e-4
    assert (new.recurrent[0] - s).abs().max() <= 1e-4


def test_lower_bound_gate_never_decays_faster_than_its_bound():
    cfg = KdaConfig(num_heads=2, head_dim=8, gate="lower_bound", gate_lower_bound=-5.0)
    layer = KdaAttention(20, cfg, eps=1e-5)
    _randomize(layer, 7)
    from tokenspeed.model.ops.kda import kda_gate

    f = torch.randn(100, 2, 8) * 50
    g = kda_gate(f, layer.A_log.detach(), layer.dt_bias.detach(), "lower_bound", -5.0)
    assert g.min() >= -5.0 and g.max() <= 0.0
    assert g.min() < -4.9 and g.max() > -0.1  # the bound is approached from both sides


def test_situ_formula():
    gate = torch.linspace(-60, 60, 241)[:, None].expand(241, 241)
    up = torch.linspace(-80, 80, 241)[None, :].expand(241, 241)
    got = situ_glu(gate, up, 4.0, 25.0)
    want = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-6)
    assert got.abs().max() <= 4.0 * 25.0
    assert not torch.allclose(got, F.silu(gate) * up)


def test_dense_first_layer():
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=2)
    cfg = model.config
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, GluMlp)
    assert mlp.gate_proj.weight.shape == (cfg.dense_intermediate_size, cfg.hidden_size)
    assert all(isinstance(layer.mlp, MoE) for layer in model.model.layers[1:])
    x = torch.randn(5, cfg.hidden_size)
    g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    a = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)
    with torch.no_grad():
        assert (mlp(x) - a @ mlp.down_proj.weight.T).abs().max() <= TOL
