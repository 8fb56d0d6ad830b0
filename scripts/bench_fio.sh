#!/usr/bin/env bash
# strata's I/O engines against fio on the same 4 GiB file, alternating tools within each round:
# sequential read and write, O_DIRECT, (1 MiB, qd 32) and (128 KiB, qd 64), fio's io_uring engine
# with its default buffers and with huge-page buffers (--mem=shmhuge, after reserving huge pages
# with sysctl vm.nr_hugepages; the old value is restored on exit). Prints strata / fio per case
# for both strata engines (median of ROUNDS rounds).
#
# Usage: scripts/bench_fio.sh [DIR] [BUILD_DIR]       (run as root for sysctl / apt-get)
# Environment: ROUNDS (default 3), SIZE (default 4GiB), JSON_OUT (file for the raw results).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-/var/tmp/strata-bench-fio}
build=${2:-$root/build}
rounds=${ROUNDS:-3}
size=${SIZE:-4GiB}
strata=$build/strata
py=/usr/bin/python3

[ -x "$strata" ] || { echo "bench_fio: $strata not built (STRATA_TARGETS=strata_cli scripts/build.sh $build)" >&2; exit 1; }
if ! command -v fio >/dev/null; then
  echo "bench_fio: installing fio (apt-get)" >&2
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q fio >&2; else sudo apt-get install -y -q fio >&2; fi
fi
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

mkdir -p "$dir"
file=$dir/bench.dat
size_bytes=$($py -c "
import re,sys; s='$size'; m=re.fullmatch(r'(\d+)\s*(GiB|MiB|KiB|B)?', s)
print(int(m.group(1)) * {'GiB':1<<30,'MiB':1<<20,'KiB':1<<10,'B':1,None:1}[m.group(2)])")

# Huge pages for fio --mem=shmhuge (and strata's MAP_HUGETLB buffers): 256 x 2 MiB.
old_hp=$(cat /proc/sys/vm/nr_hugepages)
restore() { as_root sysctl -q -w vm.nr_hugepages="$old_hp" || true; }
trap restore EXIT
as_root sysctl -q -w vm.nr_hugepages=$((old_hp > 256 ? old_hp : 256))
echo "bench_fio: huge pages $(grep HugePages_Free /proc/meminfo | awk '{print $2}') free (was $old_hp reserved)" >&2

if [ ! -f "$file" ] || [ "$(stat -c %s "$file")" -lt "$size_bytes" ]; then
  echo "bench_fio: laying out $size at $file" >&2
  fio --name=layout --filename="$file" --size="$size_bytes" --rw=write --bs=1M --iodepth=32 \
      --ioengine=io_uring --direct=1 --output=/dev/null >&2
fi

results=$(mktemp)
echo "bench_fio: load before: $(uptime)" >&2
run_strata() {  # engine rw bs qd
  # The file is the one this script laid out: --overwrite lets the write cases write into it.
  "$strata" bench io --dir "$dir" --file "$file" --size "${size_bytes}B" --block-size "$3" --overwrite \
    --queue-depth "$4" --rw "$2" --engine "$1" --direct-io required --json |
    $py -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_second"])'
}
run_fio() {  # mem rw bs qd
  local mem=()
  [ "$1" = huge ] && mem=(--mem=shmhuge)
  fio --name=bench --filename="$file" --size="$size_bytes" --rw="$2" --bs="$3" --iodepth="$4" \
      --ioengine=io_uring --direct=1 --numjobs=1 "${mem[@]}" --output-format=json |
    $py -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(j["'"$2"'"]["bw_bytes"])'
}
for round in $(seq "$rounds"); do
  for case in "read 1MiB 32" "write 1MiB 32" "read 128KiB 64" "write 128KiB 64"; do
    set -- $case
    rw=$1 bs=$2 qd=$3
    bs_fio=${bs/iB/}  # fio: 1M, 128K
    # ABBA: odd rounds run the four tools in this order, even rounds in reverse, so that no tool
    # always runs in the same position (the virtual disk's state carries over from one run to the
    # next: with a fixed order strata's io_uring always ran first, fio with huge pages last).
    tools="uring fio threads fio_huge"
    [ $((round % 2)) = 0 ] && tools="fio_huge threads fio uring"
    for tool in $tools; do
      case $tool in
        uring) echo "$rw $bs $qd strata_io_uring $(run_strata io_uring "$rw" "$bs" "$qd")" >>"$results" ;;
        fio) echo "$rw $bs $qd fio_default $(run_fio default "$rw" "$bs_fio" "$qd")" >>"$results" ;;
        threads) echo "$rw $bs $qd strata_threads $(run_strata threads "$rw" "$bs" "$qd")" >>"$results" ;;
        fio_huge) echo "$rw $bs $qd fio_hugepages $(run_fio huge "$rw" "$bs_fio" "$qd")" >>"$results" ;;
      esac
    done
    echo "bench_fio: round $round $rw $bs qd$qd done" >&2
  done
done
echo "bench_fio: load after: $(uptime)" >&2

$py - "$results" "${JSON_OUT:-}" <<'EOF'
import json, statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
cases = []
data = {}
for rw, bs, qd, tool, bps in rows:
    key = (rw, bs, int(qd))
    if key not in data:
        cases.append(key)
        data[key] = {}
    data[key].setdefault(tool, []).append(float(bps))
gb = lambda v: f"{v / 1e9:6.2f}"
print(f"{'case':<22}{'uring':>8}{'threads':>9}{'fio':>8}{'fio-huge':>10}"
      f"{'uring/fio-huge':>16}{'threads/fio-huge':>18}{'uring/fio':>11}   (GB/s, median of {len(data[cases[0]]['fio_default'])})")
out = []
for key in cases:
    m = {t: statistics.median(v) for t, v in data[key].items()}
    rw, bs, qd = key
    print(f"{rw + ' ' + bs + ' qd' + str(qd):<22}{gb(m['strata_io_uring']):>8}{gb(m['strata_threads']):>9}"
          f"{gb(m['fio_default']):>8}{gb(m['fio_hugepages']):>10}"
          f"{m['strata_io_uring'] / m['fio_hugepages']:>16.2f}{m['strata_threads'] / m['fio_hugepages']:>18.2f}"
          f"{m['strata_io_uring'] / m['fio_default']:>11.2f}")
    out.append({"rw": rw, "block_size": bs, "queue_depth": qd, "bytes_per_second": m,
                "samples": data[key]})
if sys.argv[2]:
    json.dump(out, open(sys.argv[2], "w"), indent=2)
EOF
rm -f "$results"
