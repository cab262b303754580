"""Per-rank loading: a rank's model, built on meta and transformed, reads only its share.

No processes: the transforms only slice tensors, so each rank's model is built in this process
with the groups it would have (no process group handles). The rank's loaded tensors must be the
corresponding slices of the full model's, and the bytes read exactly the rank's tensor bytes.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tokenspeed.model import KimiForCausalLM, get_preset
from tokenspeed.model.hf_writer import save_checkpoint
from tokenspeed.model.init import init_random_weights
from tokenspeed.model.layers.moe import MoE
from tokenspeed.model.loader import CheckpointError, load_checkpoint
from tokenspeed.parallel.dep import apply_dep
from tokenspeed.parallel.dims import ParallelDims
from tokenspeed.parallel.groups import Group, ParallelGroups
from tokenspeed.parallel.loading import load_rank_checkpoint, slices_of
from tokenspeed.parallel.tp import apply_tp
from tokenspeed.parallel.tp_subgroup import apply_tp_subgroup


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = init_random_weights(KimiForCausalLM(get_preset("tiny")), seed=5).eval()
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(model, path, layout="k3", max_shard_bytes=256 << 10)
    return path, load_checkpoint(path)


def _groups(world: int, rank: int, *, ep: int = 1, tp: int = 1) -> ParallelGroups:
    """This rank's groups without process groups (enough for transforms, which only slice)."""
    dims = ParallelDims(world_size=world, ep=ep, tp=tp)
    groups = {}
    for kind in ("tp", "ep", "tep", "dcp", "dwdp"):
        size = getattr(dims, kind)
        first = rank // size * size
        groups[kind] = Group(None, tuple(range(first, first + size)), rank)
    return ParallelGroups(dims, rank, torch.device("cpu"), groups)


def _meta_model() -> KimiForCausalLM:
    with torch.device("meta"):
        return KimiForCausalLM(get_preset("tiny"))


def _tensor_bytes(model) -> int:
    state = model.state_dict()
    state.pop("lm_head.weight") if model.config.tie_word_embeddings else None
    return sum(t.numel() * t.element_size() for t in state.values())


def _check_slices_of_full(model, full) -> None:
    slices = slices_of(model)
    reference = full.state_dict()
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cpu", name
        want = reference[name]
        if name in slices:
            dim, start, stop = slices[name]
            want = want.narrow(dim, start, stop - start)
        assert torch.equal(tensor, want), name


@pytest.mark.parametrize("world", [2, 4])
def test_a_dep_rank_reads_exactly_its_experts(checkpoint, world):
    path, full = checkpoint
    config = full.config
    experts = config.moe.num_experts
    full_bytes = _tensor_bytes(full)
    for rank in range(world):
        model = _meta_model()
        apply_dep(model, _groups(world, rank, ep=world))
        slices = slices_of(model)
        per = experts // world
        moe_layers = [n for n, m in model.named_modules() if isinstance(m, MoE)]
        assert len(slices) == 3 * len(moe_layers)
        for layer in moe_layers:
            for w in ("w1", "w2", "w3"):
                assert slices[f"{layer}.experts.{w}"] == (0, rank * per, (rank + 1) * per)
        stats = load_rank_checkpoint(path, model)
        _check_slices_of_full(model, full)
        rank_bytes = _tensor_bytes(model)
        assert stats.bytes_read == rank_bytes  # exactly the rank's tensors, nothing else
        assert stats.checkpoint_bytes == full_bytes
        # The routed experts are half of the tiny model: a rank reads its E/R of them and the rest.
        expert_bytes = sum(
            math.prod(full.state_dict()[f"{layer}.experts.{w}"].shape) * 4
            for layer in moe_layers
            for w in ("w1", "w2", "w3")
        )
        assert rank_bytes == full_bytes - expert_bytes + expert_bytes // world
        assert stats.bytes_read < {2: 0.8, 4: 0.65}[world] * full_bytes
        assert 0 < stats.header_bytes < 0.1 * full_bytes
        assert stats.files == len(list(path.glob("*.safetensors")))


def test_dep_and_tp_subgroup_ranks_read_their_experts_and_projection_rows(checkpoint):
    path, full = checkpoint
    world, tp = 4, 2
    reads = []
    for rank in range(world):
        model = _meta_model()
        groups = _groups(world, rank, ep=world, tp=tp)
        apply_dep(model, groups)
        apply_tp_subgroup(model, groups)
        slices = slices_of(model)
        assert slices["model.layers.0.self_attn.q_proj.weight"][0] == 0
        assert slices["model.layers.3.self_attn.o_proj.weight"][0] == 0
        stats = load_rank_checkpoint(path, model)
        _check_slices_of_full(model, full)
        assert stats.bytes_read == _tensor_bytes(model)
        reads.append(stats.bytes_read)
    assert max(reads) < 0.5 * _tensor_bytes(full)


def test_a_tep_rank_reads_its_heads_and_expert_columns(checkpoint):
    """TEP slices heads and expert intermediates, and KDA's conv taps as [start, stop) of each
    of the stacked q | k | v blocks: loading for a rank equals transforming the full model."""
    path, full = checkpoint
    world = 2
    for rank in range(world):
        groups = ParallelGroups(
            ParallelDims(world_size=world, tep=world),
            rank,
            torch.device("cpu"),
            {
                kind: Group(None, tuple(range(world)) if kind == "tep" else (rank,), rank)
                for kind in ("tp", "ep", "tep", "dcp", "dwdp")
            },
        )
        expected = copy.deepcopy(full)
        apply_tp(expected, groups)
        want = expected.state_dict()
        # max_gap_bytes=0: exactly the rank's bytes; the default reads the expert columns and
        # o_proj's input columns in spans through their holes (fewer reads, more bytes).
        reads = {}
        for gap in (0, None):
            model = _meta_model()
            apply_tp(model, groups)
            conv = slices_of(model)["model.layers.0.self_attn.conv_weight"]
            assert conv[3] == 3  # one slice of each of three blocks
            options = {} if gap is None else {"max_gap_bytes": gap}
            stats = load_rank_checkpoint(path, model, **options)
            for name, tensor in model.state_dict().items():
                assert torch.equal(tensor, want[name]), name
            reads[gap] = stats
        exact, spans = reads[0], reads[None]
        assert exact.bytes_read == _tensor_bytes(model) < _tensor_bytes(full)
        assert exact.bytes_read < spans.bytes_read <= spans.checkpoint_bytes
        assert spans.reads < exact.reads / 4


def test_a_rank_model_with_a_wrong_slice_is_refused_before_reading(checkpoint):
    path, _ = checkpoint
    model = _meta_model()
    apply_dep(model, _groups(2, 1, ep=2))
    # A mark that disagrees with the tensor's shape (a transform's bug) is named.
    experts = model.model.layers[1].mlp.experts
    experts.__dict__["_tokenspeed_shards"]["w1"] = type(
        experts.__dict__["_tokenspeed_shards"]["w1"]
    )(0, 0, 3)
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.experts.w1: the model holds"):
        load_rank_checkpoint(path, model)
