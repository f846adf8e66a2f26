package shm

import "github.com/kvxfer/kvxfer/engine/shm/internal/blkcopy"

// CopyBlocks copies n blocks of blk bytes, block j from src[j*srcStride:]
// to dst[j*dstStride:] (strides in bytes; dst and src must not overlap),
// with the copy a shm write batch of at least
// transport.SHMOptions.StreamMinBytes (default 1 MiB) uses for each of
// its pieces: non-temporal stores where the CPU has AVX (Streaming), a
// copy() loop otherwise. It is the bare copy without an engine (no
// regions, no fence units, no goroutines), exported so a benchmark can time
// a transfer shape's own copy ceiling on this host beside the engine's
// batch (segengine's BenchmarkSGLangPairs). It panics, naming the sizes,
// when a block falls outside dst or src.
func CopyBlocks(dst, src []byte, n, blk, dstStride, srcStride uint64) {
	blkcopy.Blocks(dst, src, n, blk, dstStride, srcStride)
}

// Streaming reports whether CopyBlocks (and so a large write batch) copies
// with non-temporal stores on this machine: amd64 with AVX, not built with
// the purego tag.
func Streaming() bool { return blkcopy.Streaming() }
