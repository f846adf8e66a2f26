//go:build cgo

package main

import (
	"os"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/engine/transport"
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

// KVXFER_SHM_STREAM_MIN is read here, at the edge, into
// transport.SHMOptions.StreamMinBytes (the shm engine package no longer
// reads it); a bad value fails kvx_engine_create naming the variable.
func TestSHMStreamMinEnv(t *testing.T) {
	for _, c := range []struct {
		v    string
		want uint64
	}{{"", 0}, {"off", transport.SHMStreamOff}, {"0", transport.SHMStreamOff}, {"1", 1}, {"4194304", 4 << 20}} {
		opts, err := transportOptions(func(string) string { return c.v })
		if err != nil || opts.SHM.StreamMinBytes != c.want {
			t.Errorf("%s=%q: StreamMinBytes %d, %v; want %d", shmStreamMinEnv, c.v, opts.SHM.StreamMinBytes, err, c.want)
		}
	}
	if v, ok := os.LookupEnv(shmStreamMinEnv); ok {
		t.Skipf("%s is set in the test's environment (%q)", shmStreamMinEnv, v)
	}
	t.Cleanup(func() { unsetenvC(shmStreamMinEnv) })
	setenvC(shmStreamMinEnv, "4M")
	e, err := newEngine(engineConfig{role: 0, transport: "shm"})
	if err == nil {
		e.close()
		t.Fatalf("kvx_engine_create with %s=4M succeeded", shmStreamMinEnv)
	}
	for _, want := range []string{`KVXFER_SHM_STREAM_MIN="4M"`, "want a byte count", `"off"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
}
