//go:build cgo

package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/testenv"
)

const headerPath = "../include/kvxfer.h"

var (
	protoRE   = regexp.MustCompile(`(?m)^KVX_API [^;]*?\b(kvx_[a-z0-9_]+)\s*\(`)
	exportRE  = regexp.MustCompile(`(?m)^//export (kvx_[a-z0-9_]+)$`)
	cDefRE    = regexp.MustCompile(`(?m)^[a-z][a-z_ *]*\b(kvx_[a-z0-9_]+)\(`)
	enumValRE = regexp.MustCompile(`(?m)^\s*(KVX_(?:OK|ERR_[A-Z_]+))\s*=\s*(\d+)`)
)

func readHeader(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(headerPath)
	if err != nil {
		t.Fatalf("read the C header: %v", err)
	}
	return string(b)
}

// declared returns the kvx_ functions the header declares with KVX_API.
func declared(t *testing.T) []string {
	var names []string
	for _, m := range protoRE.FindAllStringSubmatch(readHeader(t), -1) {
		names = append(names, m[1])
	}
	if len(names) == 0 {
		t.Fatal("no KVX_API prototypes found in the header")
	}
	sort.Strings(names)
	return slices.Compact(names)
}

// implemented returns the kvx_ functions the package defines: //export in Go
// files and non-static definitions in C files.
func implemented(t *testing.T) []string {
	var names []string
	gos, _ := filepath.Glob("*.go")
	cs, _ := filepath.Glob("*.c")
	for _, f := range append(gos, cs...) {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		re := exportRE
		if strings.HasSuffix(f, ".c") {
			re = cDefRE
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			names = append(names, m[1])
		}
	}
	sort.Strings(names)
	return slices.Compact(names)
}

func diff(a, b []string) (onlyA []string) {
	for _, x := range a {
		if !slices.Contains(b, x) {
			onlyA = append(onlyA, x)
		}
	}
	return onlyA
}

// TestHeaderMatchesSources compares the header's prototypes with the
// package's definitions, both directions (fast, no build).
func TestHeaderMatchesSources(t *testing.T) {
	decl, impl := declared(t), implemented(t)
	if d := diff(decl, impl); len(d) > 0 {
		t.Errorf("declared in kvxfer.h but not implemented in capi/: %v", d)
	}
	if d := diff(impl, decl); len(d) > 0 {
		t.Errorf("implemented in capi/ but not declared in kvxfer.h: %v", d)
	}
}

// TestStatusEnumMatchesHeader checks enum kvx_status against the Go codes.
func TestStatusEnumMatchesHeader(t *testing.T) {
	got := map[status]string{}
	for _, m := range enumValRE.FindAllStringSubmatch(readHeader(t), -1) {
		v, _ := strconv.Atoi(m[2])
		if prev, dup := got[status(v)]; dup {
			t.Errorf("kvx_status value %d used by both %s and %s", v, prev, m[1])
		}
		got[status(v)] = m[1]
	}
	for v, name := range statusNames {
		if got[v] != name {
			t.Errorf("status %d: header says %q, Go says %q", v, got[v], name)
		}
	}
	for v, name := range got {
		if _, ok := statusNames[v]; !ok {
			t.Errorf("header enumerator %s = %d has no Go status", name, v)
		}
	}
}

// sharedLibEnv names a libkvxfer.so built from this tree that
// TestLibraryExportsMatchHeader checks instead of building its own: `make
// test` sets it to the library it has just brought up to date for the
// Python tests (build/python/libkvxfer.so, rebuilt when a Go or C source
// changes), which saves a second c-shared build (~1-2 min of CPU in CI).
const sharedLibEnv = "KVXFER_TEST_CSHARED_LIB"

// TestLibraryExportsMatchHeader builds libkvxfer.so (or takes the one
// sharedLibEnv names) and compares its dynamic symbol table (nm -D
// --defined-only) with the header, both directions.
func TestLibraryExportsMatchHeader(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the c-shared library; skipped with -short")
	}
	nm := testenv.RequireTool(t, "nm", "the export check (apt-get install binutils)")
	lib := os.Getenv(sharedLibEnv)
	if lib != "" {
		if _, err := os.Stat(lib); err != nil {
			t.Fatalf("%s=%s: %v (unset it to build the library here)", sharedLibEnv, lib, err)
		}
	} else {
		lib = filepath.Join(t.TempDir(), "libkvxfer.so")
		cmd := exec.Command("go", "build", "-buildmode=c-shared", "-o", lib, ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build -buildmode=c-shared: %v\n%s", err, out)
		}
	}
	out, err := exec.Command(nm, "-D", "--defined-only", lib).Output()
	if err != nil {
		t.Fatalf("nm -D %s: %v", lib, err)
	}
	var exported []string
	for _, line := range bytes.Split(out, []byte("\n")) {
		f := strings.Fields(string(line))
		if len(f) == 3 && strings.HasPrefix(f[2], "kvx_") {
			exported = append(exported, f[2])
		}
	}
	sort.Strings(exported)
	decl := declared(t)
	if d := diff(decl, exported); len(d) > 0 {
		t.Errorf("declared in kvxfer.h but not exported by libkvxfer.so: %v", d)
	}
	if d := diff(exported, decl); len(d) > 0 {
		t.Errorf("exported by libkvxfer.so but not declared in kvxfer.h (make it static or hidden): %v", d)
	}
}
