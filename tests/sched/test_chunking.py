from hypothesis import given
from hypothesis import strategies as st

from tokenspeed.sched.chunking import checkpoint_positions, chunk_end

P, N = 16, 64  # page size, checkpoint interval in tokens (4 pages)


def test_whole_remainder_when_it_fits():
    assert chunk_end(32, 100, 200, page_size=P, interval=N) == 100


def test_cut_lands_on_checkpoint_boundary_when_one_fits():
    # Budget reaches 32 + 90 = 122: the interval boundary 64 fits, page boundary 112 is ignored.
    assert chunk_end(32, 1000, 90, page_size=P, interval=N) == 64
    assert chunk_end(0, 1000, 200, page_size=P, interval=N) == 192


def test_cut_falls_back_to_page_boundary():
    # From 64 with 40 tokens: the next interval boundary (128) is out of reach; page 96 is not.
    assert chunk_end(64, 1000, 40, page_size=P, interval=N) == 96


def test_nothing_fits_returns_start():
    assert chunk_end(64, 1000, 10, page_size=P, interval=N) == 64
    assert chunk_end(64, 1000, 0, page_size=P, interval=N) == 64
    assert chunk_end(100, 100, 50, page_size=P, interval=N) == 100


def test_checkpoints_at_interval_boundaries_and_turn_end():
    # Final chunk [0, 150): interval boundaries 64, 128, and the last full page 144.
    assert checkpoint_positions(0, 150, 150, page_size=P, interval=N) == (64, 128, 144)
    # Cut chunk [0, 128) of a 1000-token prompt: no turn-end checkpoint yet.
    assert checkpoint_positions(0, 128, 1000, page_size=P, interval=N) == (64, 128)
    # A chunk cut on a page (not interval) boundary still snapshots its end: a later chunk or
    # turn may resume exactly there.
    assert checkpoint_positions(0, 96, 1000, page_size=P, interval=N) == (64, 96)
    # Turn end that is itself an interval boundary is not listed twice.
    assert checkpoint_positions(64, 128, 128, page_size=P, interval=N) == (128,)
    # A final chunk shorter than a page, starting on the last page boundary: nothing new.
    assert checkpoint_positions(144, 150, 150, page_size=P, interval=N) == ()


@given(
    start_pages=st.integers(0, 50),
    extra=st.integers(1, 3000),
    budget=st.integers(0, 2000),
)
def test_chunk_end_properties(start_pages, extra, budget):
    start = start_pages * P
    target = start + extra
    end = chunk_end(start, target, budget, page_size=P, interval=N)
    assert start <= end <= target
    assert end - start <= budget
    if end != target:
        assert end % P == 0  # only the prompt end is off the page grid
    if end not in (start, target):
        # An interval boundary is chosen whenever one is reachable.
        reachable = (start + budget) // N * N
        assert end % N == 0 or reachable <= start
    if budget >= P or budget >= extra:
        assert end > start  # a budget of one page always makes progress


@given(
    start_pages=st.integers(0, 40),
    length=st.integers(1, 2000),
    extra=st.integers(1, 500),
    cut=st.booleans(),
)
def test_checkpoint_positions_properties(start_pages, length, extra, cut):
    start = start_pages * P
    if cut:  # a chunk the budget cut: it ends on the page grid before the prompt end
        end = start + max(length // P, 1) * P
        target = end + extra
    else:  # the final chunk
        end = target = start + length
    pos = checkpoint_positions(start, end, target, page_size=P, interval=N)
    assert list(pos) == sorted(set(pos))
    assert all(start < p <= end and p % P == 0 for p in pos)
    last = end if end < target else target - target % P
    assert all(p % N == 0 or p == last for p in pos)
    if last > start:
        assert pos[-1] == last  # the resume point (cut end or turn end) is always snapshotted
