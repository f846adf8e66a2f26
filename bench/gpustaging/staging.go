// Package gpustaging is the device↔host staging benchmark that `kvxfer
// gpucheck` and scripts/gpu-check.sh report: copies between device memory
// and host memory through a pinned bounce buffer (the tcp transport's path
// for device memory) against a plain cudaMemcpy of the same size. A
// benchmark, built on the cuda binding; it sits in bench/, not beside the
// binding (package cuda wraps the CUDA libraries only; cuda/gpucheck holds
// the GPU proof kernel).
package gpustaging

import (
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/cuda"
)

// StagingResult is one MeasureStaging run: throughput in GB/s (1e9 bytes/s)
// of each way of moving Size bytes between device memory and host memory.
type StagingResult struct {
	// Size and Chunk are in bytes; Reps is the number of timed repetitions.
	Size, Chunk uint64
	Reps        int
	// PlainDtoHPageable: one cudaMemcpy device -> pageable (Go) memory.
	PlainDtoHPageable float64
	// PlainDtoHPinned: one cudaMemcpy device -> mapped pinned memory.
	PlainDtoHPinned float64
	// StagedDtoH: Chunk-sized async copies into a pinned bounce buffer, each
	// then copied by the CPU into pageable memory (the TCP transport's path).
	StagedDtoH float64
	// PlainHtoDPageable and StagedHtoD are the same in the other direction.
	PlainHtoDPageable float64
	StagedHtoD        float64
}

// MeasureStaging times device<->host staging through a pinned bounce buffer
// against a plain cudaMemcpy of the same size on dev, after one warm-up run
// of each, and checks that the bytes arrived. size must be a positive
// multiple of chunk. It allocates size bytes of device memory, size bytes of
// pinned memory and 2*chunk bytes of bounce buffer, all freed on return.
func MeasureStaging(dev int, size, chunk uint64, reps int) (StagingResult, error) {
	res := StagingResult{Size: size, Chunk: chunk, Reps: reps}
	if size == 0 || chunk == 0 || size%chunk != 0 || reps <= 0 {
		return res, fmt.Errorf("gpustaging: size %d must be a positive multiple of chunk %d, reps %d > 0: %w", size, chunk, reps, cuda.ErrInvalidValue)
	}
	d, err := cuda.Malloc(dev, size)
	if err != nil {
		return res, err
	}
	defer cuda.Free(dev, d)
	if err := cuda.Memset(dev, d, 0x3c, size); err != nil {
		return res, err
	}
	pageable := make([]byte, size)
	pinned, err := cuda.AllocMapped(dev, size)
	if err != nil {
		return res, err
	}
	defer pinned.Close()
	bounce, err := cuda.AllocMapped(dev, 2*chunk)
	if err != nil {
		return res, err
	}
	defer bounce.Close()
	s, err := cuda.NewStream(dev)
	if err != nil {
		return res, err
	}
	defer s.Close()

	var ferr error
	gbps := func(f func() error) float64 {
		if ferr != nil {
			return 0
		}
		if ferr = f(); ferr != nil { // warm-up
			return 0
		}
		start := time.Now()
		for i := 0; i < reps; i++ {
			if ferr = f(); ferr != nil {
				return 0
			}
		}
		return float64(uint64(reps)*size) / time.Since(start).Seconds() / 1e9
	}
	bb := bounce.Bytes()
	res.PlainDtoHPageable = gbps(func() error { return cuda.CopyFromDevice(dev, pageable, d) })
	res.PlainDtoHPinned = gbps(func() error { return cuda.Memcpy(dev, pinned.Host(), uintptr(d), size, cuda.DeviceToHost) })
	clear(pageable)
	res.StagedDtoH = gbps(func() error {
		for off := uint64(0); off < size; off += chunk {
			half := (off / chunk) % 2 * chunk
			if err := s.MemcpyAsync(bounce.Host()+uintptr(half), uintptr(d)+uintptr(off), chunk, cuda.DeviceToHost); err != nil {
				return err
			}
			if err := s.Synchronize(); err != nil {
				return err
			}
			copy(pageable[off:off+chunk], bb[half:half+chunk])
		}
		return nil
	})
	if ferr == nil {
		for i := uint64(0); i < size; i += 4096 {
			if pageable[i] != 0x3c {
				return res, fmt.Errorf("gpustaging: byte %d = %#x after staged copy, want 0x3c", i, pageable[i])
			}
		}
	}
	res.StagedHtoD = gbps(func() error {
		for off := uint64(0); off < size; off += chunk {
			half := (off / chunk) % 2 * chunk
			copy(bb[half:half+chunk], pageable[off:off+chunk])
			if err := s.MemcpyAsync(uintptr(d)+uintptr(off), bounce.Host()+uintptr(half), chunk, cuda.HostToDevice); err != nil {
				return err
			}
			if err := s.Synchronize(); err != nil {
				return err
			}
		}
		return nil
	})
	res.PlainHtoDPageable = gbps(func() error { return cuda.CopyToDevice(dev, d, pageable) })
	if ferr != nil {
		return res, fmt.Errorf("gpustaging: %w", ferr)
	}
	return res, nil
}
