//go:build cgo

package gpustaging_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvxfer/kvxfer/bench/gpustaging"
	"github.com/kvxfer/kvxfer/cuda"
	"github.com/kvxfer/kvxfer/internal/testenv"
)

// loadFake builds the cuda package's fake runtime and driver (its
// testdata) and loads them; it skips without gcc (not a GPU gate).
func loadFake(t *testing.T) {
	t.Helper()
	testenv.BuildFakeCUDA(t, nil, nil).Load(t)
}

// TestFakeMeasureStaging runs the staging benchmark's code path (copies and
// the byte check) on the fake runtime; the numbers mean nothing there.
func TestFakeMeasureStaging(t *testing.T) {
	loadFake(t)
	r, err := gpustaging.MeasureStaging(0, 1<<20, 256<<10, 1)
	if err != nil {
		t.Fatal(err)
	}
	if r.StagedDtoH <= 0 || r.PlainDtoHPageable <= 0 || r.StagedHtoD <= 0 {
		t.Fatalf("MeasureStaging = %+v, want positive rates", r)
	}
	if _, err := gpustaging.MeasureStaging(0, 1000, 256, 1); !errors.Is(err, cuda.ErrInvalidValue) {
		t.Fatalf("MeasureStaging(size not a multiple of chunk) = %v, want ErrInvalidValue", err)
	}
}

// TestGPUStagingBandwidth runs MeasureStaging (pinned-bounce staging vs a
// plain cudaMemcpy of the same size) on a real GPU and logs a STAGING line
// that scripts/gpu-check.sh collects; it asserts correctness, never timing.
// Without a GPU it skips, or fails with KVXFER_REQUIRE_GPU=1.
func TestGPUStagingBandwidth(t *testing.T) {
	testenv.RequireGPU(t)
	r, err := gpustaging.MeasureStaging(0, 256<<20, 4<<20, 5)
	if err != nil {
		t.Fatal(err)
	}
	line := fmt.Sprintf("STAGING size_MiB=%d chunk_MiB=%d dtoh_plain_pageable_GBps=%.2f dtoh_plain_pinned_GBps=%.2f dtoh_staged_GBps=%.2f htod_plain_pageable_GBps=%.2f htod_staged_GBps=%.2f",
		r.Size>>20, r.Chunk>>20, r.PlainDtoHPageable, r.PlainDtoHPinned, r.StagedDtoH, r.PlainHtoDPageable, r.StagedHtoD)
	t.Log(line)
	fmt.Println(line)
}
