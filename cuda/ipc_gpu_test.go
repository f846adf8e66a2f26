//go:build cgo

package cuda_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/cuda"
)

const ipcEnv = "KVXFER_TEST_IPC_HANDLE"

// TestGPUIPCAcrossProcesses exports device memory with IPCGetHandle and has
// a child process (this test binary again) open it with IPCOpenHandle, read
// it and write back its complement, which the parent then checks.
func TestGPUIPCAcrossProcesses(t *testing.T) {
	requireGPU(t)
	const size = 1 << 20
	d, err := cuda.Malloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.Free(0, d)
	pattern := bytes.Repeat([]byte{0xa5, 0x5a, 0x01, 0xfe}, size/4)
	if err := cuda.CopyToDevice(0, d, pattern); err != nil {
		t.Fatal(err)
	}
	h, err := cuda.IPCGetHandle(0, d)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestGPUIPCChild$", "-test.v")
	cmd.Env = append(os.Environ(), ipcEnv+"="+hex.EncodeToString(h[:]))
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	got := make([]byte, size)
	if err := cuda.CopyFromDevice(0, got, d); err != nil {
		t.Fatal(err)
	}
	for i := range got {
		if got[i] != ^pattern[i] {
			t.Fatalf("byte %d = %#x after the child's write, want %#x\nchild output:\n%s", i, got[i], ^pattern[i], out)
		}
	}
}

// TestGPUIPCChild is the child half of TestGPUIPCAcrossProcesses; it does
// nothing unless started by it.
func TestGPUIPCChild(t *testing.T) {
	hx := os.Getenv(ipcEnv)
	if hx == "" {
		t.Skip("child process of TestGPUIPCAcrossProcesses only")
	}
	requireGPU(t)
	raw, err := hex.DecodeString(hx)
	if err != nil || len(raw) != len(cuda.IPCHandle{}) {
		t.Fatalf("bad handle %q: %v", hx, err)
	}
	var h cuda.IPCHandle
	copy(h[:], raw)
	p, err := cuda.IPCOpenHandle(0, h)
	if err != nil {
		t.Fatal(err)
	}
	defer cuda.IPCCloseHandle(0, p)
	buf := make([]byte, 1<<20)
	if err := cuda.CopyFromDevice(0, buf, p); err != nil {
		t.Fatal(err)
	}
	for i := range buf {
		buf[i] = ^buf[i]
	}
	if err := cuda.CopyToDevice(0, p, buf); err != nil {
		t.Fatal(err)
	}
	if err := cuda.Synchronize(0); err != nil {
		t.Fatal(err)
	}
}
