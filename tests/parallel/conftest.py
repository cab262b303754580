"""The warm rank processes of `harness.run_ranks` serve the whole package, then are stopped."""

import pytest

from .harness import stop_pool


@pytest.fixture(scope="package", autouse=True)
def _rank_pool():
    """Stop the package's warm rank processes (by PID) once its last test has run."""
    yield
    stop_pool()
