#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs `strata profile` on configs/run.yaml — a
# 1.3B-parameter model on 2 ranks whose optimizer state lives on NVMe — with the NVMe tier in a
# temporary directory this script creates (and removes). It measures this machine's tiers,
# predicts the configured step's transfer cost and checks the prediction on real steps; under
# mpirun (when the build has MPI) the 2 ranks are 2 processes, so the collectives are measured
# with the real communicator and a real 2-rank engine step is checked against its prediction.
# It writes the tuned config and the plots. About 1-2 minutes after the build.
# Usage: scripts/run.sh [CONFIG] [extra `strata profile` arguments...]
# Environment: STRATA_RUN_OUT (default build/run): profile.json, tuned.yaml, profile_*.png;
#   STRATA_RUN_NP (default 2): processes under mpirun; 1 = a single process, no mpirun.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh"
STRATA_TARGETS=strata_cli "$root/scripts/build.sh" "$root/build" >/dev/null
config=${1:-$root/configs/run.yaml}
shift || true
strata=$root/build/strata
out=${STRATA_RUN_OUT:-$root/build/run}
mkdir -p "$out"

# The NVMe tier: a fresh directory on a disk (not tmpfs, which has no O_DIRECT), mode 0700.
base=${TMPDIR:-/var/tmp}
[ -d /var/tmp ] && [ -w /var/tmp ] && [ -z "${TMPDIR:-}" ] && base=/var/tmp
work=$(mktemp -d "$base/strata-run-XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -m 700 "$work/nvme"
sed "s#RUN_NVME_DIR#$work/nvme#g" "$config" >"$work/config.yaml"

np=${STRATA_RUN_NP:-2}
launch=()
if [ "$np" -gt 1 ] && command -v mpirun >/dev/null && "$strata" info --json | grep -q '"mpi": true'; then
  # Open MPI refuses root without --allow-run-as-root (CI containers run as root).
  launch=(mpirun --allow-run-as-root --oversubscribe -np "$np")
fi
args=("$work/config.yaml" --json-file "$out/profile.json" --write-config "$out/tuned.yaml" "$@")
echo "run.sh: ${launch[*]:+${launch[*]} }strata profile $config (NVMe tier in $work/nvme)" >&2
if ! "${launch[@]}" "$strata" profile "${args[@]}"; then
  [ ${#launch[@]} -eq 0 ] && exit 1
  echo "run.sh: the $np-process run failed; running one process instead" >&2
  "$strata" profile "${args[@]}"
fi
# The tuned config names this run's temporary directory: put the placeholder (and the shipped
# config's path) back.
sed -i "s#$work/nvme#RUN_NVME_DIR#g; s#$work/config.yaml#$config#g" "$out/tuned.yaml"
echo "run.sh: wrote $out/profile.json and $out/tuned.yaml (tiers.nvme.paths: set RUN_NVME_DIR)" >&2
if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  /usr/bin/python3 "$root/scripts/plot_profile.py" "$out/profile.json" -o "$out" | sed 's/^/run.sh: plot /' >&2
fi
