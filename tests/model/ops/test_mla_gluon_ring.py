"""The TMA ring of the Gluon MLA split kernels (`gluon_ring`): the descriptors over the page
pool. The ring's loads run in every Gluon kernel case (tests/model/ops/test_mla_gluon_decode.py,
GPU-only); the descriptors are host objects and are checked here on the CPU.
"""

from __future__ import annotations

import pytest
import torch

gluon_ring = pytest.importorskip("tokenspeed.model.ops.mla.gluon_ring")


@pytest.mark.parametrize(
    ("dtype", "block_n", "chunk", "box_c"),
    [
        (torch.bfloat16, 64, None, [64, 512]),  # the default: the whole latent part in one box
        (torch.bfloat16, 64, 128, [64, 128]),
        (torch.float8_e4m3fn, 32, None, [32, 512]),
    ],
)
def test_descriptors_box_the_latent_part_and_the_shared_key(dtype, block_n, chunk, box_c):
    """Rows of the pool [NP, P, R + Dr] as one 2-D tensor; boxes of block_n rows: chunk latent
    columns (all R by default), and the Dr shared-key columns."""
    pages = torch.zeros(5, 64, 576, dtype=dtype)
    desc_c, desc_r = gluon_ring.descriptors(pages, 512, block_n, chunk)
    for desc in (desc_c, desc_r):
        assert list(desc.shape) == [5 * 64, 576]
        assert list(desc.strides) == [576, 1]
    assert list(desc_c.block_shape) == box_c
    assert list(desc_r.block_shape) == [block_n, 64]
