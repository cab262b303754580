#!/usr/bin/env bash
# Set up (system packages, venv, test extras) and run the whole default test suite plus ruff.
# Arguments go to pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$here/system-deps.sh"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extras="test,mooncake"
else
    extras="test,mooncake-cpu"
fi
TOKENSPEED_EXTRAS="$extras" source "$here/setup.sh"
cd "$here/.."
ruff check .
exec python -m pytest -q "$@"
