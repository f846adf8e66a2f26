package blkcopy

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
)

// pattern fills b with bytes that differ from their neighbours and from
// the guard byte.
func pattern(b []byte, seed int) {
	for i := range b {
		b[i] = byte(i*7+seed*13) | 1
	}
}

const guard = 0

// want is Blocks' result computed with copy() on a copy of dst.
func want(dst, src []byte, n, blk, ds, ss uint64) []byte {
	w := append([]byte(nil), dst...)
	for j := uint64(0); j < n; j++ {
		copy(w[j*ds:j*ds+blk], src[j*ss:j*ss+blk])
	}
	return w
}

// TestCopySizesAlignments: one contiguous run of every size 0..4097 at
// destination and source offsets that cover every 32-byte alignment
// class the kernel distinguishes; the bytes around the run stay as they
// were.
func TestCopySizesAlignments(t *testing.T) {
	src := make([]byte, 4097+64)
	pattern(src, 1)
	buf := make([]byte, 4097+128)
	for _, off := range []struct{ d, s int }{{0, 0}, {1, 0}, {0, 1}, {31, 7}, {32, 32}, {17, 63}, {64, 3}} {
		for size := 0; size <= 4097; size++ {
			for i := range buf {
				buf[i] = guard
			}
			dst := buf[off.d : off.d+size]
			if n := Copy(dst, src[off.s:off.s+size]); n != size {
				t.Fatalf("Copy(%d bytes, dst offset %d, src offset %d) = %d", size, off.d, off.s, n)
			}
			if !bytes.Equal(dst, src[off.s:off.s+size]) {
				t.Fatalf("Copy of %d bytes, dst offset %d, src offset %d: bytes differ", size, off.d, off.s)
			}
			for i, c := range buf {
				if (i < off.d || i >= off.d+size) && c != guard {
					t.Fatalf("Copy of %d bytes at dst offset %d wrote byte %d outside it", size, off.d, i)
				}
			}
		}
	}
}

// TestCopyShorter: Copy moves min(len(dst), len(src)) bytes, as copy() does.
func TestCopyShorter(t *testing.T) {
	src := make([]byte, 1000)
	pattern(src, 2)
	dst := make([]byte, 600)
	if n := Copy(dst, src); n != 600 || !bytes.Equal(dst, src[:600]) {
		t.Fatalf("Copy(600, 1000 bytes) = %d", n)
	}
	dst = make([]byte, 1000)
	if n := Copy(dst, src[:300]); n != 300 || !bytes.Equal(dst[:300], src[:300]) || dst[300] != 0 {
		t.Fatalf("Copy(1000, 300 bytes) = %d", n)
	}
}

// TestBlocks: strided runs of the shapes the shm transport copies (the
// SGLang head slice: 1 KiB blocks at a 2 KiB source stride into
// back-to-back 1 KiB rows), blocks below and above MinBlock and the step,
// odd strides and misaligned bases; only the blocks' bytes change.
func TestBlocks(t *testing.T) {
	for _, c := range []struct {
		n, blk, ds, ss uint64
		doff, soff     int
	}{
		{64, 1024, 1024, 2048, 0, 1024},
		{64, 1024, 2048, 1024, 0, 0},
		{3, 1024, 1024, 2048, 1, 5},
		{5, 256, 256, 512, 0, 0},
		{5, 255, 300, 512, 0, 0},
		{5, 257, 300, 301, 3, 0},
		{7, 128, 128, 4096, 0, 0},
		{9, 4096, 4096 + 32, 4096 + 64, 32, 64},
		{9, 4000, 4064, 4001, 0, 7},
		{4, 4097, 5000, 4097, 31, 1},
		{1, 65536, 0, 0, 0, 0},
		{1, 65536 + 100, 0, 0, 13, 9},
		{2, 1024, 1024, 1024, 0, 0},
		{0, 1024, 1024, 1024, 0, 0},
		{8, 0, 64, 64, 0, 0},
		{3, 512, 0, 512, 0, 0}, // dst stride 0: the last block wins, as with copy()
	} {
		t.Run(fmt.Sprintf("%dx%d_d%d+%d_s%d+%d", c.n, c.blk, c.ds, c.doff, c.ss, c.soff), func(t *testing.T) {
			span := func(n, blk, stride uint64) uint64 {
				if n == 0 {
					return 0
				}
				return (n-1)*stride + blk
			}
			src := make([]byte, span(c.n, c.blk, c.ss)+uint64(c.soff)+64)
			pattern(src, 3)
			dst := make([]byte, span(c.n, c.blk, c.ds)+uint64(c.doff)+64)
			pattern(dst, 4)
			d, s := dst[c.doff:], src[c.soff:]
			w := want(d, s, c.n, c.blk, c.ds, c.ss)
			Blocks(d, s, c.n, c.blk, c.ds, c.ss)
			if i := firstDiff(d, w); i >= 0 {
				t.Fatalf("byte %d differs from copy()'s result: got %#x, want %#x", i, d[i], w[i])
			}
			if !bytes.Equal(dst[:c.doff], want(dst[:c.doff], nil, 0, 0, 0, 0)) {
				t.Fatal("bytes before dst changed")
			}
		})
	}
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// TestBlocksOutOfRange: a run that does not fit either slice panics with
// the sizes (as slicing would), before copying anything.
func TestBlocksOutOfRange(t *testing.T) {
	for _, c := range []struct {
		name           string
		dlen, slen     int
		n, blk, ds, ss uint64
	}{
		{"dst short", 1000, 4096, 2, 512, 512, 512},
		{"src short", 4096, 1023, 2, 512, 512, 512},
		{"block over dst", 100, 4096, 1, 512, 0, 0},
		{"stride overflow", 4096, 4096, 3, 512, 1 << 63, 512},
		{"count overflow", 4096, 4096, 1 << 62, 512, 512, 512},
	} {
		t.Run(c.name, func(t *testing.T) {
			dst := make([]byte, c.dlen)
			src := make([]byte, c.slen)
			pattern(src, 5)
			defer func() {
				r := recover()
				if r == nil {
					t.Fatal("no panic")
				}
				if msg := fmt.Sprint(r); !strings.Contains(msg, "do not fit") {
					t.Fatalf("panic %q does not say what did not fit", msg)
				}
				for i, c := range dst {
					if c != 0 {
						t.Fatalf("byte %d of dst written before the panic", i)
					}
				}
			}()
			Blocks(dst, src, c.n, c.blk, c.ds, c.ss)
		})
	}
}

// FuzzBlocks compares Blocks with a loop of copy() over sizes, strides
// and offsets; strides that would make two destination blocks overlap are
// skipped (the order of overlapping blocks is unspecified).
func FuzzBlocks(f *testing.F) {
	f.Add(uint16(64), uint16(1024), uint16(1024), uint16(2048), uint8(0), uint8(0))
	f.Add(uint16(3), uint16(300), uint16(333), uint16(301), uint8(5), uint8(31))
	f.Add(uint16(1), uint16(4097), uint16(0), uint16(0), uint8(1), uint8(2))
	f.Fuzz(func(t *testing.T, n, blk, ds, ss uint16, doff, soff uint8) {
		n %= 70
		if n > 1 && uint64(ds) < uint64(blk) {
			return
		}
		span := func(stride uint16) int {
			if n == 0 {
				return 0
			}
			return (int(n)-1)*int(stride) + int(blk)
		}
		src := make([]byte, span(ss)+int(soff))
		pattern(src, int(blk))
		dst := make([]byte, span(ds)+int(doff)+7)
		pattern(dst, int(n))
		d, s := dst[doff:], src[soff:]
		w := want(d, s, uint64(n), uint64(blk), uint64(ds), uint64(ss))
		Blocks(d, s, uint64(n), uint64(blk), uint64(ds), uint64(ss))
		if i := firstDiff(d, w); i >= 0 {
			t.Fatalf("%d×%d (strides %d, %d; offsets %d, %d): byte %d = %#x, copy() gives %#x", n, blk, ds, ss, doff, soff, i, d[i], w[i])
		}
	})
}
