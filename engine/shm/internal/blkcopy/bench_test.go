package blkcopy

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkShapes: the copy alone, on the shapes of SGLang's 4K-token
// request (python/bench.py's sglang row, BenchmarkSGLang in
// engine/segengine): 64 buffers × 4,096 tokens, pages of 64 tokens placed
// by random page tables on both sides; "tokens" copies each page's 64
// head slices (1 KiB at a 2 KiB source stride, into 64 back-to-back 1 KiB
// rows), "dense" the same 1 KiB blocks read back to back (the source
// stride's cost apart from the per-block one), "pages" the same bytes as
// 64 KiB runs; "copy" is a loop of
// copy() (runtime.memmove: the shm transport before this package),
// "blocks" is Blocks. 256 MiB written per op.
func BenchmarkShapes(b *testing.B) {
	const bufs, toks, page, slice = 64, 4096, 64, 1024
	src := make([]byte, bufs*toks*2*slice)
	dst := make([]byte, bufs*toks*slice)
	pattern(src, 1)
	pattern(dst, 2)
	r := rand.New(rand.NewPCG(1, 2))
	sp, dp := r.Perm(toks/page), r.Perm(toks/page)
	type run struct{ s, d, n, blk, ss, ds uint64 }
	var tokens, pages, dense []run
	for bf := uint64(0); bf < bufs; bf++ {
		for p := 0; p < toks/page; p++ {
			s, d := uint64(sp[p]), uint64(dp[p])
			pages = append(pages, run{bf*toks*2*slice + s*page*slice, bf*toks*slice + d*page*slice, 1, page * slice, 0, 0})
			dense = append(dense, run{bf*toks*2*slice + s*page*slice, bf*toks*slice + d*page*slice, page, slice, slice, slice})
			tokens = append(tokens, run{bf*toks*2*slice + s*page*2*slice + slice, bf*toks*slice + d*page*slice, page, slice, 2 * slice, slice})
		}
	}
	for _, shape := range []struct {
		name string
		runs []run
	}{{"tokens", tokens}, {"dense", dense}, {"pages", pages}} {
		for _, k := range []string{"copy", "blocks"} {
			b.Run(shape.name+"/"+k, func(b *testing.B) {
				b.SetBytes(int64(len(dst)))
				for b.Loop() {
					for _, ru := range shape.runs {
						d, s := dst[ru.d:], src[ru.s:]
						if k == "blocks" {
							Blocks(d, s, ru.n, ru.blk, ru.ds, ru.ss)
							continue
						}
						for j := uint64(0); j < ru.n; j++ {
							copy(d[j*ru.ds:j*ru.ds+ru.blk], s[j*ru.ss:j*ru.ss+ru.blk])
						}
					}
				}
			})
		}
	}
}
