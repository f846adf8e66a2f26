//go:build amd64 && !purego

package blkcopy

import (
	"unsafe"

	"github.com/klauspost/cpuid/v2"
)

// haveKernel: the CPU and the OS support AVX (cpuid checks XSAVE's YMM state).
var haveKernel = cpuid.CPU.Supports(cpuid.AVX)

// blocksNT is the assembly kernel (blocks_amd64.s): n > 0 blocks of blk
// bytes (a positive multiple of 128), strided on both sides, written with
// non-temporal stores (dst and dstStride 32-byte aligned), the source
// prefetched ahead bytes on; it ends with SFENCE.
//
//go:noescape
func blocksNT(dst, src unsafe.Pointer, n, blk, dstStride, srcStride, ahead uintptr)
