#!/usr/bin/env bash
# Fails when a generated file (go:generate: stringer's *_string.go) is not
# what `go generate ./...` writes from the current sources: someone changed a
# const block and did not regenerate (or edited the output by hand). Run by
# .ci/run (~15-35 s: stringer type-checks each package it runs on; go run
# caches the binary). On failure the regenerated files are left in place.
set -euo pipefail
cd "$(dirname "$0")/.."
sums() { find . -path ./build -prune -o -name '*_string.go' -print0 | sort -z | xargs -0 -r sha256sum; }
before=$(sums)
go generate ./...
after=$(sums)
if [ "$before" != "$after" ]; then
	echo "generated files were not current; 'go generate ./...' changed:"
	diff <(echo "$before") <(echo "$after") | sed -n 's/^> [0-9a-f]*  //p'
	echo "commit the regenerated files"
	exit 1
fi
echo "generated files are current"
