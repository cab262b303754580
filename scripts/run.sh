#!/usr/bin/env bash
# The main job on the embedded default: set up, then generate from a few prompts with the `tiny`
# preset and print tokens/s. Arguments go to `tokenspeed generate` (try --help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOKENSPEED_EXTRAS="" source "$here/setup.sh"
exec tokenspeed generate "$@"
