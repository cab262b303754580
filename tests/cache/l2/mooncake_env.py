"""When the Mooncake tests may skip, and when they must fail instead.

They skip only where the mooncake wheel is not installed at all (a venv without the `mooncake` /
`mooncake-cpu` extra). Where it is installed, as `scripts/test.sh` (CI) always does, an environment
that cannot run it (a missing system library, a missing binary) is a failure, so the cross-process
tests never disappear from CI behind a skip.
"""

from __future__ import annotations

import importlib.util

import pytest

from tokenspeed.cache.l2.mooncake_services import environment_ready

MOONCAKE_INSTALLED = importlib.util.find_spec("mooncake") is not None

needs_mooncake = pytest.mark.skipif(
    not MOONCAKE_INSTALLED,
    reason="mooncake-transfer-engine is not installed (the mooncake / mooncake-cpu extra)",
)


def require_mooncake() -> None:
    """Fail (not skip) the calling test when an installed mooncake cannot run here."""
    reason = environment_ready()
    if reason is not None:
        pytest.fail(
            f"mooncake is installed but cannot run here: {reason} (scripts/system-deps.sh "
            "installs its Debian libraries: libibverbs1 libnuma1 libcurl4)",
            pytrace=False,
        )
