// Package blkcopy copies runs of equal-sized blocks between two byte slices
// that do not overlap, with non-temporal stores where the CPU has them.
//
// It exists for the shm transport's copy of large batches: a strided
// request (SGLang's per-token head slices: 1 KiB blocks read at a 2 KiB
// source stride, 262,144 of them per 4K-token request) costs one
// runtime.memmove call per block, and every cache line the copy writes is
// first read for ownership. Blocks copies a whole strided piece in one
// call: 32-byte AVX loads, the source prefetched a few blocks ahead (the
// hardware prefetchers stop at 4 KiB pages, which a 2 KiB stride crosses
// every other block) and VMOVNTDQ stores, which skip the read for
// ownership and leave the sender's caches alone. The destination is a
// receiver's memory that this process does not read again, so the stores
// bypassing the cache cost nothing there.
//
// Ordering: every call that used non-temporal stores ends with SFENCE, so
// the bytes it copied are globally visible before any store the caller
// makes after it returns (the shm transport's commit word and committed
// counter, written after the copy, can never be seen before the pages).
//
// Without AVX (or on other architectures, or with the purego build tag)
// Blocks is a loop of copy(): the same bytes, main's speed.
package blkcopy
