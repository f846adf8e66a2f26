//go:build amd64 && !purego

#include "textflag.h"

// func blocksNT(dst, src unsafe.Pointer, n, blk, dstStride, srcStride, ahead uintptr)
//
// Copies n > 0 blocks of blk bytes (blk > 0, a multiple of 128) from src
// to dst, block j at src+j*srcStride and dst+j*dstStride, in 128-byte
// steps: two PREFETCHT0 of the source ahead bytes on, four 32-byte AVX
// loads, four non-temporal 32-byte stores (VMOVNTDQ: dst and dstStride
// 32-byte aligned). Ends with SFENCE: every byte stored is globally
// visible before any store the caller makes after the call.
TEXT ·blocksNT(SB), NOSPLIT, $0-56
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ blk+24(FP), R8
	MOVQ dstStride+32(FP), R9
	MOVQ srcStride+40(FP), R10
	MOVQ ahead+48(FP), R11

block:
	MOVQ DI, AX
	MOVQ SI, BX
	MOVQ R8, DX

step:
	PREFETCHT0 (BX)(R11*1)
	PREFETCHT0 64(BX)(R11*1)
	VMOVDQU    (BX), Y0
	VMOVDQU    32(BX), Y1
	VMOVDQU    64(BX), Y2
	VMOVDQU    96(BX), Y3
	VMOVNTDQ   Y0, (AX)
	VMOVNTDQ   Y1, 32(AX)
	VMOVNTDQ   Y2, 64(AX)
	VMOVNTDQ   Y3, 96(AX)
	ADDQ       $128, AX
	ADDQ       $128, BX
	SUBQ       $128, DX
	JNZ        step
	ADDQ       R9, DI
	ADDQ       R10, SI
	DECQ       CX
	JNZ        block
	SFENCE
	VZEROUPPER
	RET
