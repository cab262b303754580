"""On a GPU: `Fp8Linear`'s CUDA path (`torch._scaled_mm` over e4m3 activations with 1 x 128 group
scales and the 128 x 128 block-scaled weight) computes the dequantised-weight `F.linear`, and
shapes it does not take fall back to the dequantising path exactly.

Error bounds (relative Frobenius norm, ||got - want|| / ||want||):
- against `F.linear` with the bf16 activations and the dequantised weight (what the CPU path
  computes), <= REL_TOL = 0.05: the FP8 path rounds each activation to e4m3 (3 mantissa bits:
  round-to-nearest error up to 2^-4 relative, ~2.5% rms for Gaussian entries, as the CPU test of
  one linear measures: ~0.026 in tests/model/test_fp8_checkpoint.py); errors of independent
  entries average out in the dot products, so the outputs carry about the same ~2.5%: 2x room.
- against an fp32 emulation of the same FP8 operands (the activations quantised by the same
  Triton kernel, dequantised in fp32, times the dequantised weight), <= SAME_OPERANDS_TOL = 0.01:
  only the accumulation order and the bf16 rounding of the output (2^-9 relative, ~0.2% rms)
  differ, so a wrong scale layout (a transposed or shifted block scale) fails it by far. The
  weights' blocks and the activations' 128-column groups get scales 2^-2 .. 2^3 apart so that a
  misplaced scale changes the result.

If this torch build (or its cuBLAS) does not take blockwise scales on this device,
`test_torch_scaled_mm_takes_block_scales` fails and says so (Fp8Linear then serves every call
through the dequantising path: correct, but the FP8 path is untested), and the tests of the
`_scaled_mm` path are skipped with that reason rather than passing on the fallback.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.model.layers import fp8_linear
from tokenspeed.model.layers.fp8_linear import Fp8Linear, quantize_fp8_blockwise

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
REL_TOL = 0.05
SAME_OPERANDS_TOL = 0.01
# (in_features, out_features): K / 128 = 8 and 3 (not a multiple of 4: builds that want the
# block scales' rows padded to 4 refuse it), N / 128 = 6 and 5.
SHAPES = [(1024, 768), (512, 640)]  # out 768, 640: 6 and 5 weight-block rows
# 1 and 7: fewer rows than cuBLAS' 16-byte alignment of the M-major scales; 300: several tiles.
TOKEN_COUNTS = [1, 7, 16, 300]
# The real op, for the capability probe: the tests count the calls through `torch._scaled_mm`.
_SCALED_MM = torch._scaled_mm


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm()).item()


@functools.cache
def block_scale_support() -> str | None:
    """None when `torch._scaled_mm` takes DeepSeek-style scales (1 x 128 activation groups,
    128 x 128 weight blocks) here, else why not (the error, torch / CUDA versions, device)."""
    from tokenspeed.model.ops.moe.fp8 import quantize_fp8_rows_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 256, device="cuda", generator=gen)
    w = torch.randn(256, 256, device="cuda", generator=gen)
    q, s = quantize_fp8_rows_reference(x)
    wq, ws = quantize_fp8_blockwise(w)
    try:
        _SCALED_MM(
            q,
            wq.t(),
            scale_a=s.t().contiguous().t(),
            scale_b=ws.t(),
            out_dtype=torch.bfloat16,
        )
        torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError) as err:
        cap = torch.cuda.get_device_capability()
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) on "
            f"{torch.cuda.get_device_name()} (sm{cap[0]}{cap[1]}): torch._scaled_mm refuses "
            f"blockwise scales: {type(err).__name__}: {str(err)[:500]}"
        )
    return None


def needs_block_scales() -> None:
    why = block_scale_support()
    if why is not None:
        pytest.skip(
            f"the FP8 _scaled_mm path cannot run (see test_torch_scaled_mm_takes_"
            f"block_scales): {why}"
        )


@pytest.fixture(autouse=True)
def scaled_mm_calls(monkeypatch):
    """Each test starts with the `_scaled_mm` path on (a failure turns it off for the process:
    a later test would then pass on the fallback) and sees how often it ran."""
    monkeypatch.setattr(fp8_linear, "_scaled_mm_broken", None)
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


def fp8_layer(in_features: int, out_features: int, seed: int = 0, block=(128, 128)) -> Fp8Linear:
    """A bf16 linear with block magnitudes 2^-2 .. 2^3 apart, rounded to FP8 blocks."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.05
    rows, cols = -(-out_features // block[0]), -(-in_features // block[1])
    exps = torch.randint(-2, 4, (rows, cols), device="cuda", generator=gen).float()
    w = (
        w
        * (2**exps)
        .repeat_interleave(block[0], 0)[:out_features]
        .repeat_interleave(block[1], 1)[:, :in_features]
    )
    linear = nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(w)
    return Fp8Linear.from_linear(linear, block)


def activations(tokens: int, in_features: int, seed: int = 1, dtype=torch.bfloat16):
    """[tokens, in] with per-token and per-128-column-group magnitudes 2^-2 .. 2^3 apart."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, in_features, device="cuda", generator=gen)
    groups = -(-in_features // 128)
    g = torch.randint(-2, 4, (groups,), device="cuda", generator=gen).float()
    t = torch.randint(-2, 4, (tokens, 1), device="cuda", generator=gen).float()
    x = x * (2**g).repeat_interleave(128)[:in_features] * 2**t
    return x.to(dtype)


def same_operands(layer: Fp8Linear, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 y of FP8 rows q [M, K] with scales [M, 1] or [M, K/128] and the dequantised weight."""
    if scales.shape[1] == 1:
        x = q.float() * scales
    else:
        x = q.float() * scales.repeat_interleave(128, dim=1)[:, : q.shape[1]]
    return x @ layer.dequantized_weight(torch.float32).t()


def test_torch_scaled_mm_takes_block_scales():
    """The check the `_scaled_mm` tests stand on: fails (and says why) on a torch build or
    device without DeepSeek-style blockwise FP8 scaling (cuBLASLt >= 12.9 on sm90)."""
    why = block_scale_support()
    assert why is None, why


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_scaled_mm_forward_matches_the_dequantised_linear(
    scaled_mm_calls, in_features, out_features, tokens
):
    needs_block_scales()
    from tokenspeed.model.ops.moe.fp8 import quantize_fp8_rows

    layer = fp8_layer(in_features, out_features)
    x = activations(tokens, in_features)
    assert fp8_linear._scaled_mm_applies(layer, x)
    got = layer(x)
    assert fp8_linear._scaled_mm_broken is None, fp8_linear._scaled_mm_broken
    assert len(scaled_mm_calls) == 1  # the FP8 path ran, no fallback
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_features)
    want = F.linear(x, layer.dequantized_weight(torch.bfloat16))
    err = rel(got, want)
    q, s = quantize_fp8_rows(x.contiguous())
    exact = rel(got, same_operands(layer, q, s))
    print(
        f"K={in_features} N={out_features} M={tokens}: vs F.linear {err:.4f}, "
        f"vs the same FP8 operands {exact:.5f}"
    )
    assert 0 < err <= REL_TOL  # > 0: the activations were quantised (not the fallback)
    assert exact <= SAME_OPERANDS_TOL
    # Leading dimensions go through the same path.
    lead = layer(x.reshape(1, tokens, in_features))
    assert lead.shape == (1, tokens, out_features)
    assert rel(lead[0], got) <= SAME_OPERANDS_TOL


@pytest.mark.parametrize("per_token", [True, False], ids=["per-token", "1x128-groups"])
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_forward_quantized_matches_the_dequantised_linear(
    scaled_mm_calls, in_features, out_features, tokens, per_token
):
    """FP8 rows with one scale per token (as the KDA output tail emits them) or per 1 x 128
    group go to `_scaled_mm` as they are."""
    needs_block_scales()
    from tokenspeed.model.ops.mla import quantize_rows_e4m3
    from tokenspeed.model.ops.moe.fp8 import quantize_fp8_rows

    layer = fp8_layer(in_features, out_features, seed=2)
    x = activations(tokens, in_features, seed=3)
    if per_token:
        q, s = quantize_rows_e4m3(x)
        s = s[:, None]
    else:
        q, s = quantize_fp8_rows(x.contiguous())
    assert q.dtype == FP8
    assert fp8_linear._scaled_mm_applies_quantized(layer, q, torch.bfloat16)
    got = layer.forward_quantized(q, s, torch.bfloat16)
    assert fp8_linear._scaled_mm_broken is None, fp8_linear._scaled_mm_broken
    assert len(scaled_mm_calls) == 1
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_features)
    err = rel(got, F.linear(x, layer.dequantized_weight(torch.bfloat16)))
    exact = rel(got, same_operands(layer, q, s))
    print(
        f"K={in_features} N={out_features} M={tokens} per_token={per_token}: vs F.linear "
        f"{err:.4f}, vs the same FP8 operands {exact:.5f}"
    )
    assert err <= REL_TOL
    assert exact <= SAME_OPERANDS_TOL
    # Leading dimensions: [2, T, K] rows with [2, T, s] scales.
    if tokens % 2 == 0:
        half = tokens // 2
        lead = layer.forward_quantized(
            q.reshape(2, half, in_features), s.reshape(2, half, -1), torch.bfloat16
        )
        assert lead.shape == (2, half, out_features)
        assert rel(lead.reshape(tokens, -1), got) <= SAME_OPERANDS_TOL


@pytest.mark.parametrize(
    "in_features, out_features, block, dtype",
    [
        (200, 96, (128, 128), torch.bfloat16),  # not multiples of 128
        (384, 200, (128, 128), torch.bfloat16),  # out not a multiple of 128
        # in not a multiple of 512: cuBLAS computed it wrongly (fp8_linear._cublas_shape)
        (384, 640, (128, 128), torch.bfloat16),
        (256, 256, (64, 64), torch.bfloat16),  # blocks other than 128 x 128
        (256, 256, (128, 128), torch.float32),  # fp32 activations
    ],
)
def test_shapes_scaled_mm_does_not_take_use_the_dequantising_path_exactly(
    scaled_mm_calls, in_features, out_features, block, dtype
):
    layer = fp8_layer(in_features, out_features, seed=4, block=block)
    for tokens in (1, 16, 300):
        x = activations(tokens, in_features, seed=5, dtype=dtype)
        assert not fp8_linear._scaled_mm_applies(layer, x)
        got = layer(x)
        want = F.linear(x, layer.dequantized_weight(dtype))
        assert torch.equal(got, want)
    assert scaled_mm_calls == []
    assert fp8_linear._scaled_mm_broken is None


def test_forward_quantized_off_the_scaled_mm_shapes_is_the_dequantising_reference(
    scaled_mm_calls,
):
    """Not multiples of 128, or an fp32 output: the activations and the weight dequantised in
    fp32, `F.linear`, cast (exactly the CPU reference)."""
    from tokenspeed.model.ops.mla import quantize_rows_e4m3

    for (in_features, out_features), out_dtype in (
        ((200, 96), torch.bfloat16),
        ((256, 256), torch.float32),
    ):
        layer = fp8_layer(in_features, out_features, seed=6)
        x = activations(16, in_features, seed=7)
        q, s = quantize_rows_e4m3(x)
        got = layer.forward_quantized(q, s[:, None], out_dtype)
        want = F.linear(q.float() * s[:, None], layer.dequantized_weight(torch.float32))
        assert torch.equal(got, want.to(out_dtype))
    assert scaled_mm_calls == []
