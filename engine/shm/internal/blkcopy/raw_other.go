//go:build !amd64 || purego

package blkcopy

import "unsafe"

// haveKernel is false: Blocks copies with copy().
const haveKernel = false

// blocksNT is never called without the kernel (haveKernel is false).
func blocksNT(dst, src unsafe.Pointer, n, blk, dstStride, srcStride, ahead uintptr) {
	panic("blkcopy: no copy kernel on this architecture")
}
