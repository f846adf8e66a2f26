package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// TestGPUCheckFakeCUDA runs `kvxfer gpucheck`'s checks against the fake CUDA
// libraries of cuda/testdata (device memory is host memory there, and the
// fake driver runs the proof kernel's logic on the CPU): the command's ring
// proof, transfer and staging plumbing all run with no GPU.
func TestGPUCheckFakeCUDA(t *testing.T) {
	fake := testenv.BuildFakeCUDA(t, nil, nil)
	cuda.Close()
	t.Setenv("KVXFER_CUDART", fake.Runtime)
	t.Setenv("KVXFER_LIBCUDA", fake.Driver)
	t.Setenv("KVXFER_NVRTC", fake.NVRTC)
	defer cuda.Close()

	var log bytes.Buffer
	rows, err := runGPUCheck(&log, 4<<20, 8<<20, 30*time.Second)
	if err != nil {
		t.Fatalf("runGPUCheck: %v\n%s", err, log.String())
	}
	got := map[string]gpuCheckRow{}
	for _, r := range rows {
		got[r.Check] = r
	}
	for _, check := range []string{"cuda", "device 0", "ring proof (ptx)", "tcp host->host 4MiB", "shm host->host 4MiB", "staging DtoH pinned bounce"} {
		if r, ok := got[check]; !ok || !r.OK {
			t.Errorf("check %q = %+v (present %v), want ok", check, r, ok)
		}
	}
	for _, check := range []string{"tcp cuda->cuda 4MiB", "shm cuda->cuda 4MiB"} {
		if r := got[check]; !r.OK && !r.Unsupported {
			t.Errorf("check %q = %+v, want ok or unsupported", check, r)
		}
	}
	if r := got["ring proof (nvrtc)"]; r.OK || !r.Unsupported || !strings.Contains(r.Detail, "NVRTC") {
		t.Errorf("ring proof (nvrtc) without NVRTC = %+v, want n/a naming NVRTC", r)
	}
	var out bytes.Buffer
	printGPUCheck(&out, rows)
	if !strings.HasPrefix(out.String(), "CHECK") || !strings.Contains(out.String(), "ring proof (ptx)") {
		t.Errorf("table:\n%s", out.String())
	}
	t.Logf("gpucheck on fake CUDA:\n%s", out.String())
}
