#!/usr/bin/env bash
# Builds the Python package `strata` (the extension strata._strata + python/strata/*.py) from an
# unpacked scripts/gpu_bundle.sh bundle, for THIS machine's python3, torch and pybind11: the only
# compile a GPU node without a package registry does (scripts/gpu_check.sh --bundle runs it).
# It compiles python/src/*.cpp with g++ and links the bundle's prebuilt static libraries (every
# layer), its shared libraries (liburing, yaml-cpp, xxhash), NCCL and the CUDA runtime.
#   - pybind11: torch's own copy (torch/include/pybind11: the internals torch was built with, so
#     that the ProcessGroup cast works, review R3), else pip's (`import pybind11`), else the
#     system's (/usr/include/pybind11); STRATA_PYBIND11=torch|pip|system|DIR forces one. torch's
#     torch._C._PYBIND11_{COMPILER_TYPE,STDLIB,BUILD_ABI} are passed as -DPYBIND11_* (what torch's
#     cpp_extension does), torch._C._GLIBCXX_USE_CXX11_ABI as -D_GLIBCXX_USE_CXX11_ABI on the
#     files that include torch's headers.
#   - NCCL: torch's wheel (nvidia/nccl/lib), else the CUDA toolkit's (/usr/local/cuda/lib64),
#     else the system's; STRATA_NCCL_LIB=/path/libnccl.so.2 forces one. The CUDA runtime: torch's
#     wheel, the toolkit's, else the bundle's lib/cuda.
#
# Usage: scripts/gpu_pybuild.sh BUNDLE_DIR [OUT_DIR]
#   BUNDLE_DIR  the unpacked bundle's strata-gpu/ folder (src/, build/, lib/)
#   OUT_DIR     where strata/ goes (default BUNDLE_DIR/python): PYTHONPATH=OUT_DIR
# Environment: PY (default python3), STRATA_JOBS (parallel compiles, default nproc), CXX (g++),
#              STRATA_PYBIND11, STRATA_NCCL_LIB.
# Exit code: 0 when `import strata, strata.torch` works from OUT_DIR; 1 otherwise (step named).
set -euo pipefail

case "${1:-}" in -h|--help|"") sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
                               [ -n "${1:-}" ]; exit $? ;; esac
bundle=$(cd "$1" && pwd)
out=${2:-$bundle/python}
mkdir -p "$out/strata"
out=$(cd "$out" && pwd)
PY=${PY:-python3}
CXX=${CXX:-g++}
jobs=${STRATA_JOBS:-$(nproc)}
S=$bundle/src B=$bundle/build L=$bundle/lib
obj=$out/obj
step=""
on_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then echo "gpu_pybuild: FAILED at: ${step:-?} (rc $rc)" >&2; fi
}
trap on_exit EXIT
say() { step=$1; echo "-- gpu_pybuild: $1"; }

say "checking the bundle"
for f in "$S/python/src/module.cpp" "$B/include/strata/build_info.hpp"; do
  [ -f "$f" ] || { echo "gpu_pybuild: $f is missing: not an unpacked bundle?" >&2; exit 1; }
done
mapfile -t archives < <(find "$B/src" -maxdepth 2 -name 'libstrata_*.a' | sort)
[ "${#archives[@]}" -gt 0 ] || { echo "gpu_pybuild: no libstrata_*.a under $B/src" >&2; exit 1; }

say "asking $PY about Python, torch and pybind11"
# One interpreter run; KEY=VALUE lines (values without newlines).
facts=$("$PY" - "${STRATA_PYBIND11:-auto}" <<'EOF'
import glob, os, sys, sysconfig
import torch
want = sys.argv[1]
tdir = os.path.dirname(torch.__file__)
print("PYVER=%d.%d" % sys.version_info[:2])
print("PYINC=" + sysconfig.get_paths()["include"])
print("EXT=" + sysconfig.get_config_var("EXT_SUFFIX"))
print("TORCH=" + torch.__version__)
print("TORCH_CUDA=%s" % torch.version.cuda)
print("ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI))
bases = [os.path.join(tdir, "include")]  # a wheel's; Debian's libtorch-dev has them in /usr/include
if not os.path.isfile(os.path.join(bases[0], "ATen", "ATen.h")):
    bases.append("/usr/include")
inc = bases + [os.path.join(b, "torch", "csrc", "api", "include") for b in bases]
print("TINC=" + ":".join(p for p in inc if os.path.isdir(p)))
libs = [os.path.join(tdir, "lib")] + ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
print("TLIB=" + next((d for d in libs if os.path.exists(os.path.join(d, "libtorch_cpu.so"))), ""))
defs = []
for n in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
    v = getattr(torch._C, "_PYBIND11_" + n, None)
    if v is not None:
        defs.append('-DPYBIND11_%s="%s"' % (n, v))
print("PBDEFS=" + " ".join(defs))
choices = {"torch": os.path.join(tdir, "include")}
try:
    import pybind11
    choices["pip"] = pybind11.get_include()
except ImportError:
    pass
choices["system"] = "/usr/include"
order = ["torch", "pip", "system"] if want == "auto" else [want]
pick = ""
for c in order:
    d = choices.get(c, c)  # a name, or a directory given as STRATA_PYBIND11=DIR
    if os.path.isfile(os.path.join(d, "pybind11", "pybind11.h")):
        pick = "%s:%s" % (c, d)
        break
print("PYBIND11=" + pick)
# NCCL and the CUDA runtime from torch's wheel (nvidia-* packages), where it has them.
nccl, cudart = "", ""
try:
    import nvidia
    for root in list(nvidia.__path__):
        nccl = nccl or next(iter(sorted(glob.glob(os.path.join(root, "*", "lib", "libnccl.so*")))), "")
        cudart = cudart or next(iter(sorted(glob.glob(os.path.join(root, "*", "lib", "libcudart.so*")))), "")
except ImportError:
    pass
print("WHEEL_NCCL=" + nccl)
print("WHEEL_CUDART=" + cudart)
EOF
) || { echo "gpu_pybuild: $PY cannot import torch" >&2; exit 1; }
get() { printf '%s\n' "$facts" | sed -n "s/^$1=//p"; }
pyinc=$(get PYINC) ext=$(get EXT) abi=$(get ABI) tlib=$(get TLIB) pb=$(get PYBIND11)
IFS=: read -r -a tinc <<<"$(get TINC)"
read -r -a pbdefs <<<"$(get PBDEFS)"
[ -f "$pyinc/Python.h" ] || { echo "gpu_pybuild: no Python.h in $pyinc (python3-dev)" >&2; exit 1; }
[ -n "$pb" ] || { echo "gpu_pybuild: no pybind11 headers (STRATA_PYBIND11=${STRATA_PYBIND11:-auto})" >&2; exit 1; }
[ -n "$tlib" ] || { echo "gpu_pybuild: libtorch_cpu.so not found beside torch" >&2; exit 1; }
pbdir=${pb#*:}
pbver=$(sed -n 's/^#define PYBIND11_VERSION_\(MAJOR\|MINOR\|PATCH\) *\([0-9a-z]*\).*/\2/p' \
          "$pbdir/pybind11/detail/common.h" 2>/dev/null | paste -sd. -)
echo "python $(get PYVER) ($PY), torch $(get TORCH) (CUDA $(get TORCH_CUDA), C++11 ABI $abi)," \
     "pybind11 ${pbver:-?} (${pb%%:*}: $pbdir), $("$CXX" --version | head -1)"
echo "pybind11 internals as torch's: ${pbdefs[*]:-(torch names none)}"
[ "$abi" = 1 ] || echo "WARNING: torch uses the old C++ ABI (_GLIBCXX_USE_CXX11_ABI=0); the bundle's" \
                      "libraries use the new one: the link of c10d_communicator.cpp may fail"

# NCCL and the CUDA runtime for the link (the same sonames torch loads first at run time: R9).
nccl=${STRATA_NCCL_LIB:-}
for c in "$(get WHEEL_NCCL)" /usr/local/cuda/lib64/libnccl.so.2 \
         "$(ldconfig -p 2>/dev/null | awk '$1 == "libnccl.so.2" && p == "" {p = $NF} END {print p}')"; do
  if [ -z "$nccl" ] && [ -n "$c" ] && [ -e "$c" ]; then nccl=$c; fi
done
cudart=""
for c in "$(get WHEEL_CUDART)" /usr/local/cuda/lib64/libcudart.so.* "$L"/cuda/libcudart.so.*; do
  if [ -z "$cudart" ] && [ -n "$c" ] && [ -e "$c" ]; then cudart=$c; fi
done
echo "nccl: ${nccl:-none}; cudart: ${cudart:-none}"

# ---- compile: every python/src/*.cpp, in parallel ----------------------------------------------
say "compiling python/src ($jobs jobs)"
rm -rf "$obj" && mkdir -p "$obj"
common=(-std=gnu++20 -O2 -DNDEBUG -fPIC -fvisibility=hidden -fvisibility-inlines-hidden
        -I"$S/python/src" -I"$S/src" -I"$S/include" -I"$B/include" -isystem "$pyinc")
if [ "$pbdir" != /usr/include ]; then common+=(-isystem "$pbdir"); fi
common+=("${pbdefs[@]}")
torchflags=("-D_GLIBCXX_USE_CXX11_ABI=$abi" -Wno-unused-parameter)
for d in "${tinc[@]}"; do
  case "$d" in /usr/include|/usr/local/include|"") ;; *) torchflags+=(-isystem "$d") ;; esac
done
pids=() srcs=()
for f in "$S"/python/src/*.cpp; do
  o=$obj/$(basename "${f%.cpp}").o
  flags=("${common[@]}")
  # Only the files that include torch's headers get them (and torch's ABI), as python/CMakeLists.txt.
  if grep -qE '#include *<(torch|ATen|c10)/' "$f"; then flags+=("${torchflags[@]}"); fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 0.2; done
  "$CXX" "${flags[@]}" -c "$f" -o "$o" >"$o.log" 2>&1 &
  pids+=($!) srcs+=("$f")
done
bad=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "gpu_pybuild: compiling ${srcs[$i]} failed:" >&2
    tail -30 "$obj/$(basename "${srcs[$i]%.cpp}").o.log" >&2
    bad=1
  fi
done
[ "$bad" = 0 ] || exit 1

# ---- link ------------------------------------------------------------------------------------
say "linking strata/_strata$ext"
[ -n "$nccl" ] || { echo "gpu_pybuild: no libnccl.so.2 (torch's nvidia-nccl wheel, the toolkit, or" \
                         "STRATA_NCCL_LIB)" >&2; exit 1; }
[ -n "$cudart" ] || { echo "gpu_pybuild: no libcudart.so" >&2; exit 1; }
shared=()
for so in "$L"/*.so*; do if [ -f "$so" ]; then shared+=("$so"); fi; done
rpath=$L:$tlib:$(dirname "$nccl"):$(dirname "$cudart")
"$CXX" -shared -o "$out/strata/_strata$ext" "$obj"/*.o \
  -Wl,--start-group "${archives[@]}" -Wl,--end-group \
  "${shared[@]}" "$nccl" "$cudart" -L"$tlib" -ltorch_cpu -lc10 \
  -Wl,-rpath,"$rpath" -pthread -ldl >"$obj/link.log" 2>&1 ||
  { tail -30 "$obj/link.log" >&2; exit 1; }
cp "$S"/python/strata/*.py "$out/strata/"

say "import strata, strata.torch"
(cd / && PYTHONPATH=$out "$PY" -c \
  'import strata, strata.torch
print("import strata OK:", strata.__file__, "version", strata.__version__,
      "cuda", strata._strata.with_cuda)')
step=""
echo "gpu_pybuild: PYTHONPATH=$out"
