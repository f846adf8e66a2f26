//go:build cgo

package main

import (
	"os"
	"testing"
)

// A variable the host sets with libc after the library loaded is seen by
// getenv (and by the C ABI's settings that read it), though Go's os.Getenv
// still has the copy from load time.
func TestGetenvSeesHostChanges(t *testing.T) {
	const name = "KVXFER_NO_PROBE"
	if v, ok := os.LookupEnv(name); ok {
		t.Skipf("%s is set in the test's environment (%q)", name, v)
	}
	t.Cleanup(func() { unsetenvC(name) })
	if got := getenv(name); got != "" {
		t.Fatalf("getenv(%s) = %q before it was set", name, got)
	}
	setenvC(name, "1")
	if got := getenv(name); got != "1" {
		t.Fatalf("getenv(%s) = %q after libc setenv, want \"1\"", name, got)
	}
	if !envNoProbe() {
		t.Fatalf("a flag set to 1 by the host reads false")
	}
	unsetenvC(name)
	if got := getenv(name); got != "" {
		t.Fatalf("getenv(%s) = %q after unsetenv", name, got)
	}
}
