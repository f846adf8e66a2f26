//go:build cgo

package main

import (
	"strings"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// TestRegisterDetectsDevicePointer: kvx_register_memory with no location
// (NULL, "" or Mooncake's "*") asks the CUDA driver (cuPointerGetAttribute,
// here the fake library) and registers device memory as cuda:N, host
// memory as host; an explicit location is taken as given.
func TestRegisterDetectsDevicePointer(t *testing.T) {
	fake := testenv.BuildFakeCUDA(t, nil, nil)
	for _, kv := range fake.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v) // cuda.MayBePresent: CUDA may be here
	}
	fake.Load(t)
	d, err := cuda.Malloc(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(0, d)
	host, err := transport.AllocHost("detect", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()

	tests := []struct {
		name string
		addr uintptr
		kind transport.MemoryKind
	}{
		{"device", uintptr(d), transport.MemoryCUDA},
		{"inside device", uintptr(d) + 4096, transport.MemoryCUDA},
		{"host", host.Addr(), transport.MemoryHost},
	}
	for _, tc := range tests {
		kind, dev, err := detectLocation(tc.addr)
		if err != nil || kind != tc.kind || dev != 0 {
			t.Errorf("detectLocation(%s) = %s, %d, %v; want %s on device 0", tc.name, kind, dev, err, tc.kind)
		}
	}

	e, err := newEngine(engineConfig{role: 0, transport: "tcp"})
	if err != nil {
		t.Fatal(err)
	}
	defer e.close()
	for i, loc := range []string{"", "*"} {
		if _, err := e.register(host.Addr()+uintptr(i)*4096, 4096, loc); err != nil {
			t.Errorf("register host memory with location %q: %v", loc, err)
		}
		// This test's tcp transport has no bounce copier (chosen when the
		// package loaded, before the fake was set up): the refusal names the
		// detected device, which is what this checks.
		_, err := e.register(uintptr(d), 1<<20, loc)
		if err == nil || !strings.Contains(err.Error(), "cuda:0") {
			t.Errorf("register device memory with location %q: %v; want it treated as cuda:0", loc, err)
		}
	}
	// An explicit location is not second-guessed.
	if _, err := e.register(host.Addr()+8192, 4096, "cpu"); err != nil {
		t.Errorf("register with location cpu: %v", err)
	}
}

// TestDetectLocationWithoutCUDA: where CUDA cannot be present, memory with
// no location is host memory and nothing is loaded.
func TestDetectLocationWithoutCUDA(t *testing.T) {
	if cuda.MayBePresent() {
		t.Skip("CUDA may be present on this host")
	}
	kind, _, err := detectLocation(0x1000)
	if err != nil || kind != transport.MemoryHost {
		t.Fatalf("detectLocation = %s, %v; want host", kind, err)
	}
}

// TestRegisterShmPlainMemorySaysWhatToDo: a C caller's own host memory
// (malloc) on an shm engine is refused as unsupported, and the message
// names the C remedies (kvx_alloc_host, transport "cma"), not a Go API.
func TestRegisterShmPlainMemorySaysWhatToDo(t *testing.T) {
	e, err := newEngine(engineConfig{role: 1, transport: "shm"})
	if err != nil {
		t.Skipf("shm engine: %v", err)
	}
	defer e.close()
	buf := make([]byte, 1<<16) // memory with no file descriptor behind it
	_, err = e.register(uintptr(unsafe.Pointer(&buf[0])), uint64(len(buf)), "cpu")
	if err == nil {
		t.Fatal("shm registered memory without a file descriptor")
	}
	if code := codeOf(err); code != stUnsupportedMem {
		t.Errorf("status %d, want KVX_ERR_UNSUPPORTED_MEMORY (%d): %v", code, stUnsupportedMem, err)
	}
	for _, want := range []string{"kvx_alloc_host", `"cma"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
}
