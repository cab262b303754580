"""The expert-parallel layers on the one-device grouped expert kernels (a GPU in half
precision; here the Triton interpreter on the CPU, fp16) compute their torch references' sums:
a DEP rank's local experts over the rows it received (slots held by other ranks, -1, skipped;
the same load counted), DWDP experts over the block held here plus the staging buffer, and a
TEP MoE over its experts' intermediate slice.
In a fresh process: Triton decides between compiling and interpreting at import."""

import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import json
import torch
torch.set_num_threads(1)
from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.moe import MoE
from tokenspeed.model.ops import dispatch
from tokenspeed.parallel.dep import DepMoE

model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=3)
moe = next(m for m in model.modules() if isinstance(m, MoE))
moe.half()
local = moe.experts.w1.shape[0] // 2
for name in ("w1", "w2", "w3"):  # this rank's half of the experts
    p = getattr(moe.experts, name)
    p.data = p.data[:local].clone()
moe.__class__ = DepMoE
moe.dep_local_experts, moe.dep_load = local, None
gen = torch.Generator().manual_seed(0)
rows, k = 37, moe.gate.config.top_k
width = moe.experts.w1.shape[2]
x = (torch.randn(rows, width, generator=gen) * 0.5).half()
ids = torch.randint(-1, local, (rows, k), generator=gen)
weights = torch.rand(rows, k, generator=gen)
assert dispatch.fused_moe(x)  # the interpreter takes the kernel path
fused = moe._local_experts(x, weights, ids)
load = moe.dep_load.tolist()
reference = moe._local_experts_reference(x, weights, ids)
want = torch.bincount(ids[ids >= 0], minlength=local).tolist()

# DWDP: experts [2, 5) of 8 held here, the others staged (in order, skipping the block).
from tokenspeed.model.layers.moe import Experts
from tokenspeed.parallel.dwdp import DwdpExperts, routed_experts_split

full = next(m for m in model.modules() if isinstance(m, MoE) and m is not moe).experts.half()
stack = {n: getattr(full, n).data for n in ("w1", "w2", "w3")}
start, stop = 2, 5
staged = {n: torch.cat([t[:start], t[stop:]]) for n, t in stack.items()}
for n, t in stack.items():
    getattr(full, n).data = t[start:stop].clone()
full.__class__ = DwdpExperts
full.dwdp_block = (start, stop)
ids8 = torch.randint(0, stack["w1"].shape[0], (rows, k), generator=gen)
dwdp = full._forward_fused(x, weights, ids8, staged)
dwdp_ref = routed_experts_split(
    x, weights, ids8, (full.w1, full.w2, full.w3), staged, (start, stop), full.glu
)
# TEP: a MoE whose experts hold an intermediate slice (a group of one: no all-reduce), its
# grouped-kernel forward against its reference forward.
from tokenspeed.parallel.groups import Group
from tokenspeed.parallel.tp import TepMoE

last = [m for m in model.modules() if isinstance(m, MoE) and m is not moe][-1].half()
for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
    p = getattr(last.experts, name)
    p.data = p.data.narrow(dim, 0, p.shape[dim] // 2).clone()
tep = TepMoE(last, Group(None, (0,), 0), None)
hidden_in = (torch.randn(rows, model.config.hidden_size, generator=gen) * 0.5).half()
tep_fused = tep(hidden_in)
real = dispatch.fused_moe
dispatch.fused_moe = lambda x: False
tep_ref = tep(hidden_in)
dispatch.fused_moe = real

print(json.dumps({"tep": tep_fused.float().tolist(), "tep_reference": tep_ref.float().tolist(),
                  "fused": fused.tolist(), "reference": reference.tolist(),
                  "load": load, "want_load": want, "dtype": str(fused.dtype),
                  "dwdp": dwdp.float().tolist(), "dwdp_reference": dwdp_ref.float().tolist(),
                  "dwdp_dtype": str(dwdp.dtype)}))
"""


def close(got: dict, name: str, reference: str) -> None:
    a, b = torch.tensor(got[name]), torch.tensor(got[reference])
    assert a.shape == b.shape
    scale = b.abs().max().item()
    worst = (a - b).abs().max().item()
    assert scale > 0 and worst <= 0.02 * scale, (name, worst, scale)


@pytest.fixture(scope="module")
def got() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_dwdp_experts_over_block_and_staging_buffer(got):
    assert got["dwdp_dtype"] == "torch.float16"
    close(got, "dwdp", "dwdp_reference")


def test_tep_moe_on_an_intermediate_slice(got):
    close(got, "tep", "tep_reference")


def test_dep_local_experts_compute_the_reference_sums(got):
    assert got["dtype"] == "torch.float32"
    assert got["load"] == got["want_load"]
    close(got, "fused", "reference")
