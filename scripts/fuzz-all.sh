#!/usr/bin/env bash
# fuzz-all.sh DURATION — run every Go fuzz target in the module for DURATION each.
set -euo pipefail
dur=${1:-20s}
cd "$(dirname "$0")/.."
fail=0
while IFS= read -r pkg; do
  dir=$(go list -f '{{.Dir}}' "$pkg")
  for t in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //' | sort -u); do
    echo "fuzz: $pkg $t ($dur)"
    go test -run '^$' -fuzz "^${t}\$" -fuzztime "$dur" "$pkg" || { echo "fuzz: $pkg $t FAILED"; fail=1; }
  done
done < <(go list ./...)
exit $fail
