#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs `strata profile` on the shipped default
# config (measures this machine's tiers and predicts the step overhead; about a minute).
# Usage: scripts/run.sh [CONFIG] [extra strata arguments...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
STRATA_TARGETS=strata_cli "$root/scripts/build.sh" "$root/build" >/dev/null
config=${1:-$root/configs/default.yaml}
shift || true
exec "$root/build/strata" profile "$config" "$@"
