#!/usr/bin/env bash
# check_imports.sh FAKE_LIB BINARY...: fails naming every cuda*/__cuda*/nccl* function a binary
# imports that FAKE_LIB does not define.
set -euo pipefail
fake=$1
shift
defined=$(nm -D --defined-only "$fake" | awk '{print $3}' | sort -u)
status=0
for bin in "$@"; do
  imports=$(nm -D --undefined-only "$bin" | awk '{print $2}' | sed 's/@.*//' |
    grep -E '^(cuda|__cuda|nccl)' | sort -u || true)
  missing=$(comm -23 <(printf '%s\n' "$imports") <(printf '%s\n' "$defined") | grep -v '^$' || true)
  if [ -n "$missing" ]; then
    echo "$bin imports functions the fake CUDA runtime does not define:"
    # shellcheck disable=SC2086  # one name per line
    printf "  %s\n" $missing
    status=1
  else
    echo "$bin: $(printf '%s\n' "$imports" | grep -c .) cuda/nccl imports, all defined by the fake"
  fi
done
exit $status
