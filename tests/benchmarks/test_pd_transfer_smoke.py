"""benchmarks/pd_transfer.py --smoke: the handoff-bandwidth table from two CPU engines."""

import re

import pytest

from .test_spec_smoke import smoke


@pytest.mark.slow  # about 20 s; the P/D pair and its transfer statistics: tests/runtime/pd
def test_pd_transfer_smoke():
    out = smoke("pd_transfer.py")
    assert "transport socket" in out
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \|", out, re.M)
    assert [int(n) for n, _, _ in rows] == [40, 120]
    # Bytes grow with the prompt: MLA rows per token plus one KDA state per request.
    assert 0 < int(rows[0][1]) < int(rows[1][1])
