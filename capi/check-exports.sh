#!/usr/bin/env bash
# check-exports.sh LIB HEADER — the C ABI's header and library agree:
# every KVX_API prototype in HEADER is a defined dynamic symbol of LIB, and
# LIB defines no kvx_ symbol that HEADER does not declare. Used by ctest
# (capi_exports); capi/header_test.go does the same from `go test`.
set -euo pipefail
lib=${1:?usage: check-exports.sh libkvxfer.so kvxfer.h}
hdr=${2:?usage: check-exports.sh libkvxfer.so kvxfer.h}
declared=$(grep -E '^KVX_API ' "$hdr" | grep -oE '\bkvx_[a-z0-9_]+[[:space:]]*\(' | tr -d ' (' | sort -u)
exported=$(nm -D --defined-only "$lib" | awk '$3 ~ /^kvx_/ {print $3}' | sort -u)
[ -n "$declared" ] || { echo "no KVX_API prototypes found in $hdr" >&2; exit 1; }
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
extra=$(comm -13 <(echo "$declared") <(echo "$exported"))
rc=0
if [ -n "$missing" ]; then
  echo "declared in $hdr but not exported by $lib (add the //export or remove the prototype):" >&2
  echo "$missing" | sed 's/^/  /' >&2; rc=1
fi
if [ -n "$extra" ]; then
  echo "exported by $lib but not declared in $hdr (declare it with KVX_API or make it static/hidden):" >&2
  echo "$extra" | sed 's/^/  /' >&2; rc=1
fi
[ $rc -eq 0 ] && echo "ok: $(echo "$declared" | wc -l) kvx_ functions declared and exported"
exit $rc
