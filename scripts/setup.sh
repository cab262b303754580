#!/usr/bin/env bash
# Sourced by scripts/run.sh and scripts/test.sh: creates ./.venv on first use and installs tokenspeed
# with the extras named in $TOKENSPEED_EXTRAS. On a machine without an NVIDIA GPU it installs the CPU
# build of torch before anything else can ask for a (multi-GB) CUDA build.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TOKENSPEED_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
cpu_torch="2.13.0"

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
pip_q=(python -m pip install --quiet --disable-pip-version-check)

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! python -c "import torch" >/dev/null 2>&1; then
    if has_gpu; then
        "${pip_q[@]}" "torch>=2.9"
    else
        # Take the CPU wheel from the local wheel store when it is there; otherwise from PyTorch's
        # CPU index. Ask pip first which file it would take, so a CUDA wheel is never downloaded.
        report="$(mktemp)"
        python -m pip install --quiet --dry-run --no-deps --ignore-installed --report "$report" \
            "torch==$cpu_torch" >/dev/null 2>&1 || true
        if grep -q "+cpu" "$report" 2>/dev/null; then
            "${pip_q[@]}" "torch==$cpu_torch"
        else
            "${pip_q[@]}" "torch==$cpu_torch" --index-url https://download.pytorch.org/whl/cpu
        fi
        rm -f "$report"
    fi
fi

if ! has_gpu && python -c "import torch, sys; sys.exit(torch.version.cuda is None)"; then
    echo "setup: a CUDA build of torch is installed on a machine without a GPU; remove $venv" >&2
    exit 1
fi

extras="${TOKENSPEED_EXTRAS:-}"
stamp="$venv/.tokenspeed-installed-$(echo "$extras" | tr ',' '-')"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    if [ -n "$extras" ]; then
        "${pip_q[@]}" -e "$root[$extras]"
    else
        "${pip_q[@]}" -e "$root"
    fi
    touch "$stamp"
fi
