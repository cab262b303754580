#!/usr/bin/env bash
# Debian packages the test suite needs (Mooncake's transfer engine links against these).
# Installs only what is missing; does nothing where apt is not available.
set -euo pipefail
packages=(libibverbs1 libnuma1 libcurl4)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: apt-get not found; install ${missing[*]} by hand" >&2
    exit 0
fi
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
