#!/usr/bin/env bash
# Clang's thread-safety analysis (-Wthread-safety -Werror=thread-safety) over the library layers
# whose locked state is annotated (GUARDED_BY, REQUIRES: src/core/thread_annotations.hpp and the
# annotated lock types of src/core/mutex.hpp). Configures a clang build (its own build directory,
# CUDA off: the analysis is of host code) and analyses every translation unit of those layers
# with the build's own compile commands, -fsyntax-only (the analysis needs no code generation).
# Run by scripts/test.sh (what CI runs); exits 1 on any finding, naming file and line.
# Usage: scripts/check_thread_safety.sh [BUILD_DIR]      (default: build-tsa)
# Environment: STRATA_CLANG (default clang++-16, else clang++), STRATA_JOBS (default: number of cores).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-tsa}
clangxx=${STRATA_CLANG:-$(command -v clang++-16 || echo clang++)}
jobs=${STRATA_JOBS:-$(nproc)}
# The layers whose mutex-guarded state carries annotations. zero and checkpoint hold none: an
# Engine is driven by one thread and its collaborators share state only through the store, the
# filler and the communicator (tier, comm), which are analysed here.
layers="core io tier comm"

if ! command -v "$clangxx" >/dev/null; then
  echo "check_thread_safety: $clangxx not found (apt-get install clang-16)" >&2
  exit 1
fi
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$clangxx" -DCMAKE_BUILD_TYPE=Debug \
  -DSTRATA_WITH_CUDA=OFF -DSTRATA_WITH_PYTHON=OFF -DSTRATA_BUILD_TESTS=OFF \
  -DSTRATA_BUILD_BENCHMARKS=OFF -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  "-DCMAKE_CXX_FLAGS=-Wthread-safety -Werror=thread-safety" >/dev/null

/usr/bin/env python3 - "$build/compile_commands.json" "$root" "$jobs" $layers <<'PY'
import json, shlex, subprocess, sys
from concurrent.futures import ThreadPoolExecutor

db, root, jobs, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
units = []
for e in json.load(open(db)):
    rel = e["file"][len(root) + 1:] if e["file"].startswith(root + "/") else e["file"]
    parts = rel.split("/")
    if len(parts) > 2 and parts[0] == "src" and parts[1] in layers and rel.endswith(".cpp"):
        args = shlex.split(e["command"])
        # Drop the output: -o FILE, and analyse only.
        out = []
        skip = False
        for a in args:
            if skip:
                skip = False
                continue
            if a == "-o":
                skip = True
                continue
            out.append(a)
        units.append((rel, e["directory"], out + ["-fsyntax-only"]))

def check(unit):
    rel, cwd, cmd = unit
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return rel, r.returncode, r.stderr

failed = 0
with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
    for rel, rc, err in pool.map(check, sorted(units)):
        if rc != 0:
            failed += 1
            sys.stderr.write(err)
            print("check_thread_safety: %s: failed" % rel)
if not units:
    print("check_thread_safety: no translation units found for layers %s" % " ".join(layers))
    sys.exit(1)
print("check_thread_safety: %d translation units of %s analysed, %d failed"
      % (len(units), " ".join(layers), failed))
sys.exit(1 if failed else 0)
PY
