"""tokenspeed.types: the small shared types (tested here, next to their main user)."""

from __future__ import annotations

import pytest

from tokenspeed.types import TokenSpan


def test_token_span():
    assert len(TokenSpan(3, 10)) == 7
    assert TokenSpan(0, 0) == TokenSpan(0, 0)
    with pytest.raises(ValueError, match="start"):
        TokenSpan(5, 4)
