//go:build !cgo

package main

import (
	"fmt"
	"os"
)

// init reports why this build is empty: the C ABI needs cgo
// (CGO_ENABLED=1 and a C compiler). It keeps `CGO_ENABLED=0 go vet ./...`
// working for the whole module.
func init() {
	fmt.Fprintln(os.Stderr, "kvxfer capi: built without cgo; build libkvxfer.so with CGO_ENABLED=1 go build -buildmode=c-shared ./capi")
}
