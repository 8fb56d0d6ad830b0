#!/usr/bin/env bash
# Builds, on a build host with the CUDA toolkit (no GPU needed), ONE relocatable tarball for a GPU
# node that has no package registry and no network; `scripts/gpu_check.sh --bundle FILE` runs it
# there (issue 47, point 4). The tarball holds one folder, strata-gpu/:
#   src/     a snapshot of this working tree (tracked and untracked, not ignored, files): the
#            extension's sources (python/src, python/strata), tests/python, examples, bench/step,
#            configs and scripts/gpu_check.sh + scripts/gpu_pybuild.sh themselves;
#   build/   Release, CUDA for the asked architectures, MPI and Python off, position-independent
#            code: the `strata` CLI, every CTest `gpu`-label test binary with the CTest files that
#            run them, the static libraries of every layer (src/*/libstrata_*.a) and the generated
#            header (include/strata/build_info.hpp) the Python extension links and includes;
#   lib/     the shared libraries a CUDA + PyTorch image lacks (liburing, yaml-cpp, xxhash, ...:
#            whatever the CLI and the tests need beyond glibc, libstdc++, CUDA and NCCL);
#   lib/cuda the toolkit's libcudart, a fallback for a node whose toolkit and torch have none;
#   MANIFEST what was built, from which tree, with which toolkit; the build host's path of
#            strata-gpu/ (`prefix`), which gpu_check.sh rewrites in the CTest files after unpacking.
# Relocatable: unpack it anywhere (`tar -xzf FILE -C DIR`); gpu_check.sh --bundle does so itself.
# NCCL is not packed (200+ MB): the node takes torch's (nvidia/nccl/lib) or its toolkit's.
#
# Usage: scripts/gpu_bundle.sh [--arch 90] [-o OUT.tgz] [--work DIR] [--jobs N]
#   --arch A    CMAKE_CUDA_ARCHITECTURES, e.g. 90 or "80;90" (default 90: H100/H200)
#   -o FILE     the tarball (default ./strata-gpu-sm<arch>.tgz)
#   --work DIR  where the snapshot and its build directory live (default <repo>/build-gpu-bundle;
#               kept between runs, so a second bundle rebuilds only what changed)
#   --jobs N    parallel compile jobs (default: nproc; on a shared host use 1 under nice)
# Exit code: 0 with the tarball written, 1 on any failure (the step that failed is named).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
arch=90
out=""
work=${STRATA_BUNDLE_WORK:-$root/build-gpu-bundle}
jobs=${STRATA_JOBS:-$(nproc)}
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=${2:?--arch needs a value}; shift 2 ;;
    --arch=*) arch=${1#--arch=}; shift ;;
    -o|--out) out=${2:?-o needs a file}; shift 2 ;;
    --work) work=${2:?--work needs a directory}; shift 2 ;;
    --jobs|-j) jobs=${2:?--jobs needs a number}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_bundle: unknown argument '$1' (--help)" >&2; exit 1 ;;
  esac
done
[[ "$arch" =~ ^[0-9a-z\;]+$ ]] || { echo "gpu_bundle: bad --arch '$arch' (e.g. 90 or \"80;90\")" >&2; exit 1; }
[ -n "$out" ] || out=$PWD/strata-gpu-sm${arch//;/-}.tgz
case "$out" in /*) ;; *) out=$PWD/$out ;; esac
mkdir -p "$(dirname "$out")" "$work"
work=$(cd "$work" && pwd)
stage=$work/strata-gpu         # the folder the tarball holds; its path here is the MANIFEST prefix
src=$stage/src bld=$stage/build lib=$stage/lib
t0=$(date +%s)
step=""
on_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then echo "gpu_bundle: FAILED at: ${step:-?} (rc $rc)" >&2; fi
}
trap on_exit EXIT
say() { step=$1; echo "== [$(( $(date +%s) - t0 )) s] $1"; }

say "checking the build host"
nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
[ -x "$nvcc" ] || { echo "gpu_bundle: no CUDA compiler at $nvcc (set CUDACXX)" >&2; exit 1; }
for t in cmake git tar gzip ldd; do
  command -v "$t" >/dev/null || { echo "gpu_bundle: '$t' is missing" >&2; exit 1; }
done
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cuda_release=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')

# ---- 1. a snapshot of the working tree ------------------------------------------------------
# A file whose content changed since the last snapshot is copied (its mtime: now); an unchanged
# one is left alone: ninja rebuilds exactly what changed, also for an edit made during a build
# (keeping the tree's own mtimes would miss an edit older than the object built from it).
say "snapshot of $root into $src"
fresh=$work/snapshot.tmp
rm -rf "$fresh" "$lib"
mkdir -p "$fresh" "$src" "$lib/cuda"
(cd "$root" && git ls-files -z -co --exclude-standard |
   while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done |
   tar --null --no-recursion -cf - -T -) | tar -xf - -C "$fresh"
changed=0
while IFS= read -r -d '' f; do
  if ! cmp -s "$fresh/$f" "$src/$f"; then
    mkdir -p "$(dirname "$src/$f")"
    cp --preserve=mode "$fresh/$f" "$src/$f"
    changed=$((changed + 1))
  fi
done < <(cd "$fresh" && find . -type f -print0)
while IFS= read -r -d '' f; do
  if [ ! -e "$fresh/$f" ]; then rm -f "$src/$f"; changed=$((changed + 1)); fi
done < <(cd "$src" && find . -type f -print0)
rm -rf "$fresh"
echo "$changed files changed since the last snapshot"
rev=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain 2>/dev/null | wc -l)

# ---- 2. configure and build: the CLI, every gpu-label test, every layer's static library --------
say "configure $bld (Release, CUDA $arch, MPI and Python off, PIC)"
cmake -S "$src" -B "$bld" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DSTRATA_WITH_CUDA=ON \
  "-DCMAKE_CUDA_COMPILER=$nvcc" "-DCMAKE_CUDA_ARCHITECTURES=$arch" -DSTRATA_BUILD_TESTS=ON \
  -DSTRATA_BUILD_BENCHMARKS=OFF -DSTRATA_WITH_MPI=OFF -DSTRATA_WITH_PYTHON=OFF \
  -DCMAKE_POSITION_INDEPENDENT_CODE=ON >"$work/configure.log" 2>&1 ||
  { tail -30 "$work/configure.log" >&2; exit 1; }
grep -q 'strata: CUDA ON, NCCL ON' "$work/configure.log" ||
  { grep 'strata: CUDA' "$work/configure.log" >&2
    echo "gpu_bundle: the build needs CUDA and NCCL (nccl.h + libnccl beside the toolkit)" >&2; exit 1; }

# The gpu-label tests, by their executables (strata_add_test: the target is named as the test).
say "listing the gpu-label tests"
gpu_tests=$(cd "$bld" && ctest -N -L gpu | sed -n 's/^ *Test *#[0-9]*: *\([A-Za-z0-9_]*\).*/\1/p' | sort -u)
[ -n "$gpu_tests" ] || { echo "gpu_bundle: ctest -L gpu lists no test" >&2; exit 1; }
layers=$(cd "$src/src" && for d in */; do
           if grep -qs strata_add_layer "$d/CMakeLists.txt"; then echo "strata_${d%/}"; fi
         done)
echo "gpu tests: $(echo "$gpu_tests" | tr '\n' ' ')"
say "build ($jobs jobs): strata_cli, the gpu tests, the layers"
# shellcheck disable=SC2086  # word lists of target names
cmake --build "$bld" -j "$jobs" --target strata_cli $gpu_tests $layers >"$work/build.log" 2>&1 ||
  { tail -40 "$work/build.log" >&2; exit 1; }
[ -x "$bld/strata" ] || { echo "gpu_bundle: $bld/strata was not built" >&2; exit 1; }

# ---- 3. the shared libraries a CUDA + PyTorch image lacks --------------------------------------
# Everything the CLI and the tests load, except glibc, the compiler's runtime (the node's is newer
# and torch needs it), the driver, cudart and NCCL (the node's toolkit or torch's wheel has them).
say "collecting shared libraries"
bins=("$bld/strata")
for t in $gpu_tests; do
  f=$(find "$bld/tests" -maxdepth 2 -type f -name "$t" -perm -u+x | head -1)
  [ -n "$f" ] || { echo "gpu_bundle: the binary of $t was not built" >&2; exit 1; }
  bins+=("$f")
done
skip='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libresolv|libutil|libstdc\+\+|libgcc_s'
skip+='|libcuda|libcudart|libnccl|libnvidia-ml)\.so'
for b in "${bins[@]}"; do
  if ldd "$b" | grep 'not found' >&2; then
    echo "gpu_bundle: $b has unresolved libraries" >&2; exit 1
  fi
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r soname path; do
  if ! [[ "$soname" =~ $skip ]]; then
    cp -L "$path" "$lib/$soname"
  fi
done
cudart=$(ldd "$bld/strata" | awk '$1 ~ /^libcudart\.so/ {print $3}')
if [ -n "$cudart" ]; then cp -L "$cudart" "$lib/cuda/"; fi
# The libraries the Python extension links but the CLI may not (yaml-cpp, liburing, xxhash):
for so in liburing.so.2 libyaml-cpp.so.0.7 libxxhash.so.0; do
  if [ ! -e "$lib/$so" ]; then
    p=$(ldconfig -p | awk -v s="$so" '$1 == s && /x86-64/ && p == "" {p = $NF} END {print p}')
    if [ -n "$p" ]; then cp -L "$p" "$lib/$so"; fi
  fi
done
ls "$lib" "$lib/cuda"

# ---- 4. the manifest and the tarball ---------------------------------------------------------
say "writing MANIFEST and $out"
{
  echo "format=1"
  echo "prefix=$stage"
  echo "git_rev=$rev"
  echo "dirty_files=$dirty"
  echo "cuda_architectures=$arch"
  echo "cuda_release=$cuda_release"
  echo "compiler=$(g++ -dumpfullversion 2>/dev/null || echo ?)"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  echo "gpu_tests=$(echo "$gpu_tests" | tr '\n' ' ' | sed 's/ $//')"
  echo "layers=$(cd "$bld/src" && find . -name 'libstrata_*.a' | sed 's|^\./||' | sort |
                 tr '\n' ' ' | sed 's/ $//')"
  echo "libs=$(cd "$lib" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ' | sed 's/ $//')"
} >"$stage/MANIFEST"
tar -C "$work" -czf "$out.part" \
  --exclude=CMakeFiles \
  --exclude='*.o' --exclude='*.d' --exclude='*.gch' --exclude='*.pch' --exclude='*.ninja' \
  --exclude='.ninja_*' --exclude='CMakeCache.txt' --exclude='cmake_install.cmake' \
  --exclude='strata-gpu/build/_deps' --exclude='strata-gpu/build/Testing' \
  strata-gpu
mv "$out.part" "$out"
step=""
echo "gpu_bundle: wrote $out ($(du -h "$out" | cut -f1), CUDA $cuda_release sm_$arch, tree $rev" \
     "+$dirty changed files) in $(( $(date +%s) - t0 )) s"
echo "on the GPU node: bash scripts/gpu_check.sh --bundle $(basename "$out") RESULTS_DIR" \
     "(scripts/ from this bundle: tar -xzf $(basename "$out") strata-gpu/src/scripts)"
