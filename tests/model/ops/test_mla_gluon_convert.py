"""e4m3 tiles converted for the Gluon MLA split kernel (`gluon_convert`): exact, code by code.

Gluon kernels do not run under the interpreter: GPU-only, skipped off Hopper.
"""

from __future__ import annotations

import pytest
import torch

gluon_convert = pytest.importorskip("tokenspeed.model.ops.mla.gluon_convert")
from triton.experimental import gluon  # noqa: E402  (importable where gluon_convert is)
from triton.experimental.gluon import language as gl  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is Hopper-only (wgmma)")


@gluon.jit
def _convert_codes(src, dst, N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    offs = gl.arange(0, N, layout=layout)
    x = gl.load(src + offs)
    gl.store(dst + offs, gluon_convert._to_mma_type(x, dst.dtype.element_ty))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_e4m3_tiles_convert_exactly(dtype):
    """Every e4m3 code but NaN, subnormals and -0 included, converts to the MMA type exactly
    (bit for bit torch's conversion; bf16 goes by bit moves and a multiply by 2^120)."""
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(2)
    src = codes.view(torch.float8_e4m3fn)
    out = torch.empty(512, dtype=dtype, device="cuda")
    _convert_codes[(1,)](src, out, N=512, num_warps=4)
    keep = (codes & 0x7F) != 0x7F  # e4m3fn's NaNs
    want = src.to(dtype)
    assert torch.equal(out[keep].view(torch.int16), want[keep].view(torch.int16))
