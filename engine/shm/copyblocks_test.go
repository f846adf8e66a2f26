package shm_test

import (
	"bytes"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/engine/shm"
)

// TestCopyBlocks: CopyBlocks moves exactly the strided blocks (a 1 KiB head
// slice of every 2 KiB source token into back-to-back 1 KiB slots, and a
// sparse destination), leaves every other byte alone, and panics naming the
// sizes when a block would fall outside a slice.
func TestCopyBlocks(t *testing.T) {
	for _, c := range []struct{ n, blk, ds, ss uint64 }{
		{64, 1024, 1024, 2048}, // SGLang's per-token head slices
		{8, 4096, 8192, 4096},  // sparse destination
		{1, 65536, 0, 0},       // one contiguous page
		{5, 100, 300, 200},     // under the kernel's block size
	} {
		src := make([]byte, (c.n-1)*c.ss+c.blk+c.blk)
		for i := range src {
			src[i] = byte(i*7 + i>>8)
		}
		dst := bytes.Repeat([]byte{0xee}, int((c.n-1)*c.ds+2*c.blk))
		want := bytes.Clone(dst)
		off := c.blk / 2 // source blocks start off bytes in: a head slice
		for j := uint64(0); j < c.n; j++ {
			copy(want[j*c.ds:j*c.ds+c.blk], src[off+j*c.ss:off+j*c.ss+c.blk])
		}
		shm.CopyBlocks(dst, src[off:], c.n, c.blk, c.ds, c.ss)
		if !bytes.Equal(dst, want) {
			t.Errorf("%d x %d B at strides %d/%d: the destination differs from the blocks copied one by one", c.n, c.blk, c.ds, c.ss)
		}
	}
	defer func() {
		r := recover()
		if s, _ := r.(string); !strings.Contains(s, "do not fit") {
			t.Fatalf("2 blocks of 1 KiB at a 2 KiB stride into 2 KiB: recovered %v, want a panic naming the sizes", r)
		}
	}()
	shm.CopyBlocks(make([]byte, 2048), make([]byte, 4096), 2, 1024, 2048, 2048)
}
