"""MXFP4 (compressed-tensors `mxfp4-pack-quantized`): reference decode from the format's
definition, packing, loader helpers, and the Triton decode (exact, bit for bit)."""

from __future__ import annotations

import math

import pytest
import torch

from tokenspeed.model.ops.moe.mxfp4 import (
    decode_e8m0,
    decode_mxfp4,
    dequantize_mxfp4,
    is_mxfp4_config,
    load_experts_mxfp4,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)

from .triton_interpreter import results_for


def e2m1_from_bits(code: int) -> float:
    """E2M1 from its definition: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * mantissa * 0.5  # subnormal: 0 or 0.5
    return sign * (1 + mantissa / 2) * 2.0 ** (exponent - 1)


def all_codes_and_scales(scales):
    """Packed rows covering all 256 byte values, one E8M0 scale per row of 32 columns."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)  # 32 cols
    packed = packed.repeat_interleave(len(scales), dim=0)
    scale = torch.tensor(scales * 16, dtype=torch.uint8).reshape(-1, 1)
    return packed, scale


def test_decode_matches_the_format_definition():
    scales = [0, 1, 100, 126, 127, 128, 140, 254]
    packed, scale = all_codes_and_scales(scales)
    got = decode_mxfp4(packed, scale)
    want = torch.empty_like(got, dtype=torch.float64)
    for r in range(packed.shape[0]):
        s = scale[r, 0].item()
        for c in range(32):
            byte = packed[r, c // 2].item()
            code = byte & 0xF if c % 2 == 0 else byte >> 4  # even column in the low nibble
            want[r, c] = e2m1_from_bits(code) * math.ldexp(1.0, s - 127)
    assert torch.equal(got, want.float())  # exact (fp32 overflows to inf only at scale 254)


def test_e8m0_255_is_nan():
    assert torch.isnan(decode_e8m0(torch.tensor([255], dtype=torch.uint8))).all()


def test_pack_unpack_roundtrip_and_nibble_order():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.shape == (3, 32)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0])
    assert torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(unpack_e2m1(packed), codes)


def test_quantize_is_exact_on_the_grid_and_bounded_off_it():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 64), generator=gen, dtype=torch.uint8)
    codes[:, ::32] = 7  # each group holds a 6: the largest magnitude fixes the exponent
    scale = torch.randint(110, 140, (4, 2), generator=gen, dtype=torch.uint8)
    values = decode_mxfp4(pack_e2m1(codes), scale)
    packed, scale2 = quantize_mxfp4(values)
    assert torch.equal(decode_mxfp4(packed, scale2), values)
    w = torch.randn(8, 96, generator=gen)
    err = (decode_mxfp4(*quantize_mxfp4(w)) - w).abs()
    amax = w.reshape(8, 3, 32).abs().amax(-1, keepdim=True)
    # Quantum at the top binade is amax/4 at most (2^floor(log2 amax) / 2): error <= half.
    assert (err.reshape(8, 3, 32) <= amax / 4 + 1e-7).all()


def test_recognises_compressed_tensors_configs():
    nested = {
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "weights": {"group_size": 32, "num_bits": 4},
            }
        }
    }
    assert is_mxfp4_config(nested)
    assert is_mxfp4_config({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"})
    assert not is_mxfp4_config({"format": "float-quantized"})
    assert not is_mxfp4_config(None)


def test_load_experts_keeps_tensors_packed():
    prefix = "model.layers.1.block_sparse_moe.experts"
    store = {}
    for e in range(4):
        store[f"{prefix}.{e}.w1.weight_packed"] = torch.full((6, 32), e, dtype=torch.uint8)
        store[f"{prefix}.{e}.w1.weight_scale"] = torch.full((6, 2), 100 + e, dtype=torch.uint8)
    packed, scale = load_experts_mxfp4(store.__getitem__, prefix, [2, 3], "w1", 6, 64)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 6, 32)
    assert packed[0].unique().tolist() == [2] and scale[1].unique().tolist() == [103]
    store[f"{prefix}.3.w1.weight_scale"] = torch.zeros(6, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"experts\.3\.w1\.weight_scale"):
        load_experts_mxfp4(store.__getitem__, prefix, [2, 3], "w1", 6, 64)


# ---------------------------------------------------------------- Triton decode


def _case_triton_decode_fp32_exact():
    packed, scale = all_codes_and_scales([0, 1, 64, 126, 127, 128, 200, 254, 255])
    got = dequantize_mxfp4(packed, scale, torch.float32)
    want = decode_mxfp4(packed, scale)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def _case_triton_decode_fp16_exact():
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 5, 48), generator=gen, dtype=torch.uint8)  # K = 96
    scale = torch.randint(118, 134, (3, 5, 3), generator=gen, dtype=torch.uint8)
    got = dequantize_mxfp4(packed, scale, torch.float16)
    assert got.shape == (3, 5, 96)
    assert torch.equal(got, decode_mxfp4(packed, scale, torch.float16))


CASES = {
    "triton-decode-fp32-exact": _case_triton_decode_fp32_exact,
    "triton-decode-fp16-exact": _case_triton_decode_fp16_exact,
}


@pytest.fixture(scope="module")
def interpreter_results():
    return results_for(__name__)


@pytest.mark.parametrize("case", sorted(CASES))
def test_mxfp4_under_interpreter(interpreter_results, case):
    assert interpreter_results[case] is None, interpreter_results[case]


@pytest.mark.gpu
def test_triton_decode_exact_at_k3_expert_shape():
    # One K3 expert's gate projection: [3072, 3584] -> packed [3072, 1792], scales [3072, 112].
    gen = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(0, 256, (3072, 1792), device="cuda", generator=gen, dtype=torch.uint8)
    scale = torch.randint(100, 140, (3072, 112), device="cuda", generator=gen, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        got = dequantize_mxfp4(packed, scale, dtype)
        assert torch.equal(got, decode_mxfp4(packed, scale, dtype))
