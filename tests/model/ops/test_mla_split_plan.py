import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.model.ops.mla.split_plan import (
    SplitPlanBuffers,
    launch_order,
    min_split_capacity,
    plan_decode_splits,
    target_split_len,
)

MAX_BATCH, PAR = 8, 32
CAP = min_split_capacity(MAX_BATCH, PAR)


def _splits(plan, row):
    b = plan.buffers
    lo, hi = int(b.split_indptr[row]), int(b.split_indptr[row + 1])
    return [(int(b.split_start[i]), int(b.split_len[i])) for i in range(lo, hi)]


def test_equal_chunk_lengths_on_mixed_histories():
    lens = [1_000, 64_000, 200_000, 5_000, 130_000]
    plan = plan_decode_splits(lens, parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP)
    t = plan.target_len
    assert t % 64 == 0 and t >= sum(lens) / PAR
    for row, n in enumerate(lens):
        splits = _splits(plan, row)
        assert len(splits) == -(-n // t)
        # Every split but the row's last has exactly the target length; together they tile [0, n).
        assert all(length == t for _, length in splits[:-1])
        assert 0 < splits[-1][1] <= t
        assert [s for s, _ in splits] == [i * t for i in range(len(splits))]
        assert sum(length for _, length in splits) == n
    # The longest row gets proportionally more splits, instead of every row getting the same.
    counts = plan.buffers.num_splits[: len(lens)].tolist()
    assert counts[2] > counts[0] and counts[0] == 1
    assert plan.total_splits == sum(counts) <= PAR + len(lens)


def test_metadata_has_fixed_size_whatever_the_batch():
    shapes = set()
    for lens in ([5], [1, 2, 3], [300_000] * MAX_BATCH, [64] * 4):
        plan = plan_decode_splits(lens, parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP)
        b = plan.buffers
        shapes.add(
            tuple(
                t.shape
                for t in (
                    b.num_splits,
                    b.split_indptr,
                    b.split_row,
                    b.split_start,
                    b.split_len,
                    b.split_order,
                )
            )
        )
        assert all(t.dtype == torch.int32 for t in (b.num_splits, b.split_len))
        # Padding rows have no splits; unused split slots have zero length.
        assert b.num_splits[len(lens) :].eq(0).all()
        assert b.split_indptr[len(lens) :].eq(plan.total_splits).all()
        assert b.split_len[plan.total_splits :].eq(0).all()
    assert shapes == {((MAX_BATCH,), (MAX_BATCH + 1,), (CAP,), (CAP,), (CAP,), (CAP,))}


def test_split_order_is_longest_first_with_unused_slots_last():
    lens = [1_000, 64_000, 200_000, 5_000]
    b = plan_decode_splits(lens, parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP).buffers
    order = b.split_order.tolist()
    assert sorted(order) == list(range(CAP))  # a permutation of the slots
    ordered = [int(b.split_len[i]) for i in order]
    assert ordered == sorted(ordered, reverse=True)
    # Equal lengths keep slot order (the device-side torch.argsort(stable=True) agrees).
    assert order == torch.argsort(b.split_len, descending=True, stable=True).tolist()
    assert launch_order([3, 0, 5, 3]) == [2, 0, 3, 1]


def test_out_buffers_are_filled_in_place():
    # A captured graph reads fixed addresses: a replanned batch must reuse the same storage.
    bufs = SplitPlanBuffers.allocate(MAX_BATCH, CAP)
    ptrs = [t.data_ptr() for t in (bufs.num_splits, bufs.split_len, bufs.split_start)]
    plan_decode_splits(
        [100_000, 50], parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP, out=bufs
    )
    first = bufs.split_len.clone()
    plan = plan_decode_splits(
        [7, 9, 11], parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP, out=bufs
    )
    assert plan.buffers is bufs
    assert [t.data_ptr() for t in (bufs.num_splits, bufs.split_len, bufs.split_start)] == ptrs
    assert not torch.equal(first, bufs.split_len)
    # Stale entries of the bigger earlier plan were cleared.
    assert bufs.split_len[plan.total_splits :].eq(0).all()


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="exceed max_batch"):
        plan_decode_splits([1] * 9, parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP)
    with pytest.raises(ValueError, match="parallelism \\+ max_batch"):
        plan_decode_splits([1], parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP - 1)
    with pytest.raises(ValueError, match="at least one cached token"):
        plan_decode_splits([0], parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP)
    with pytest.raises(ValueError, match="do not match"):
        plan_decode_splits(
            [1],
            parallelism=PAR,
            max_batch=MAX_BATCH,
            max_splits=CAP,
            out=SplitPlanBuffers.allocate(4, CAP),
        )


def test_target_is_page_granular_and_covers_budget():
    assert target_split_len(10, 32, 64) == 64
    assert target_split_len(64 * 32 + 1, 32, 64) == 128
    assert target_split_len(64 * 32, 32, 64) == 64


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 250_000), min_size=1, max_size=MAX_BATCH),
    par=st.integers(1, 132),
)
def test_plan_tiles_every_history_within_capacity(lens, par):
    cap = min_split_capacity(MAX_BATCH, par)
    plan = plan_decode_splits(lens, parallelism=par, max_batch=MAX_BATCH, max_splits=cap)
    b = plan.buffers
    assert plan.total_splits <= cap
    rows = b.split_row[: plan.total_splits].tolist()
    assert rows == sorted(rows)
    for row, n in enumerate(lens):
        splits = _splits(plan, row)
        assert all(
            int(b.split_row[i]) == row
            for i in range(int(b.split_indptr[row]), int(b.split_indptr[row + 1]))
        )
        assert sum(length for _, length in splits) == n
        assert max(length for _, length in splits) <= plan.target_len


def test_one_block_or_separate_tensors_give_the_same_plan():
    # allocate() makes the fields views of one block (one host-to-device copy per plan);
    # buffers put together from separate tensors are filled field by field.
    lens = [70_000, 300, 12_345]
    block = SplitPlanBuffers.allocate(MAX_BATCH, CAP)
    flat = block.block()
    assert flat is not None and flat.numel() == MAX_BATCH * 2 + 1 + 4 * CAP
    assert flat.data_ptr() == block.num_splits.data_ptr()
    separate = SplitPlanBuffers(*(torch.zeros_like(t) for t in attrs.astuple(block, recurse=False)))
    assert separate.block() is None
    for bufs in (block, separate):
        plan_decode_splits(lens, parallelism=PAR, max_batch=MAX_BATCH, max_splits=CAP, out=bufs)
    for a, b in zip(
        attrs.astuple(block, recurse=False), attrs.astuple(separate, recurse=False), strict=True
    ):
        assert torch.equal(a, b)
    assert block.split_len[: len(lens)].sum() > 0 and int(block.num_splits.sum()) == int(
        block.split_indptr[MAX_BATCH]
    )
