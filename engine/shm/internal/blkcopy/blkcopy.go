package blkcopy

import (
	"fmt"
	"unsafe"
)

// MinBlock is the smallest block, in bytes, Blocks copies with the
// assembly kernel; smaller blocks go through copy(), whose straight-line
// code for small sizes is as fast.
const MinBlock = 256

// step is the kernel's unit: four 32-byte loads and stores.
const step = 128

// aheadBlocks is how many source blocks ahead of the one being copied the
// kernel prefetches (measured on the development VM, AMD EPYC: 2, 4 and 8
// blocks of a 2 KiB stride were within noise of each other, all ahead of
// none; see bench/RESULTS.md, issue 27).
const aheadBlocks = 4

// aheadRun is the prefetch distance in bytes within one contiguous run.
const aheadRun = 2048

// Streaming reports whether Blocks uses the non-temporal kernel on this
// machine (amd64 with AVX, not built with the purego tag). Without it
// Blocks copies with copy().
func Streaming() bool { return haveKernel }

// Blocks copies n blocks of blk bytes: block j from src[j*srcStride:] to
// dst[j*dstStride:] (strides in bytes; 0 with n == 1 for one contiguous
// run). dst and src must not overlap (overlapping blocks are copied in an
// unspecified order, unlike copy()). It panics, naming the sizes, when a
// block would fall outside dst or src, as slicing them would. Blocks of at
// least MinBlock bytes are written with non-temporal stores where
// Streaming() is true, ending with SFENCE before Blocks returns.
func Blocks(dst, src []byte, n, blk, dstStride, srcStride uint64) {
	if n == 0 || blk == 0 {
		return
	}
	if !fits(uint64(len(dst)), n, blk, dstStride) || !fits(uint64(len(src)), n, blk, srcStride) {
		panic(fmt.Sprintf("blkcopy: %d blocks of %d bytes at strides %d (dst) and %d (src) do not fit dst (%d bytes) and src (%d bytes)",
			n, blk, dstStride, srcStride, len(dst), len(src)))
	}
	if !haveKernel || blk < MinBlock {
		for j := uint64(0); j < n; j++ {
			d, s := j*dstStride, j*srcStride
			copy(dst[d:d+blk], src[s:s+blk])
		}
		return
	}
	dp, sp := unsafe.Pointer(unsafe.SliceData(dst)), unsafe.Pointer(unsafe.SliceData(src))
	if blk%step == 0 && uintptr(dp)%32 == 0 && dstStride%32 == 0 {
		// Every block starts 32-byte aligned: one call for all of them.
		ahead := uintptr(aheadBlocks * srcStride)
		if n == 1 || srcStride < blk {
			ahead = aheadRun
		}
		blocksNT(dp, sp, uintptr(n), uintptr(blk), uintptr(dstStride), uintptr(srcStride), ahead)
		return
	}
	for j := uint64(0); j < n; j++ {
		d, s := j*dstStride, j*srcStride
		run(dst[d:d+blk], src[s:s+blk])
	}
}

// Copy copies min(len(dst), len(src)) bytes from src to dst, which must
// not overlap, and returns that count: copy() with Blocks' stores.
func Copy(dst, src []byte) int {
	m := min(len(dst), len(src))
	Blocks(dst, src, 1, uint64(m), 0, 0)
	return m
}

// run copies one block of at least MinBlock bytes whose destination is not
// 32-byte aligned or whose length is not a multiple of step: copy() up to
// the first aligned destination byte, the kernel for the whole steps after
// it, copy() for the rest (ordinary stores after the SFENCE: ordered after
// the non-temporal ones).
func run(dst, src []byte) {
	dp := uintptr(unsafe.Pointer(unsafe.SliceData(dst)))
	head := int((32 - dp%32) % 32)
	body := (len(dst) - head) / step * step
	copy(dst[:head], src[:head])
	if body > 0 {
		blocksNT(unsafe.Pointer(&dst[head]), unsafe.Pointer(&src[head]), 1, uintptr(body), 0, 0, aheadRun)
	}
	copy(dst[head+body:], src[head+body:])
}

// fits reports whether n blocks of blk bytes at stride fit in size bytes:
// (n-1)*stride + blk <= size, without overflow.
func fits(size, n, blk, stride uint64) bool {
	if blk > size {
		return false
	}
	if n == 1 {
		return true
	}
	if stride != 0 && n-1 > (size-blk)/stride {
		return false
	}
	return true
}
