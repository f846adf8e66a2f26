package segengine_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// BenchmarkSGLang: SGLang's per-token-slot batch with prefill TP 1 and
// decode TP 2 for a 4K-token request (64 buffers x 4096 tokens, a 1 KiB
// head slice of each 2 KiB prefill token, pages of 64 tokens scattered on
// both sides: 262,144 entries, 256 MiB) against the same bytes in
// page-sized entries, over tcp on loopback and over shm, by
// SubmitEntries. The per-token case coalesces to one strided descriptor
// per page (on tcp the bench's cost is then the kernel's: one iovec per
// 1 KiB source block; on shm one copy per block).
//
//	go test -run '^$' -bench SGLang -benchtime 6x -count 3 ./engine/segengine
func BenchmarkSGLang(b *testing.B) {
	for _, tr := range []string{"tcp", "shm"} {
		if err := transport.ProbeTransport(tr); err != nil {
			continue
		}
		b.Run(tr+"/tokens", func(b *testing.B) { benchSGLang(b, tr, false) })
		b.Run(tr+"/pages", func(b *testing.B) { benchSGLang(b, tr, true) })
	}
}

func benchSGLang(b *testing.B, tr string, pages bool) {
	recv := newTE(b, tr)
	send := newTE(b, tr)
	const bufs, toks, page, slice = 64, 4096, 64, 1024
	dst, _ := regBuf(b, recv, "dst", bufs*toks*slice)
	src, _ := regBuf(b, send, "src", bufs*toks*2*slice)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		b.Fatal(err)
	}
	defer seg.Close()
	r := rand.New(rand.NewPCG(1, 2))
	sp, dp := r.Perm(toks/page), r.Perm(toks/page)
	e := segengine.Entries{Region: segengine.PeerAddressRegion}
	for bf := uint64(0); bf < bufs; bf++ {
		if pages {
			for p := 0; p < toks/page; p++ {
				e.Local = append(e.Local, uint64(src.Addr())+bf*toks*2*slice+uint64(sp[p]*page*slice))
				e.Remote = append(e.Remote, uint64(dst.Addr())+bf*toks*slice+uint64(dp[p]*page*slice))
				e.Length = append(e.Length, page*slice)
			}
			continue
		}
		for t := 0; t < toks; t++ {
			st := uint64(sp[t/page]*page + t%page)
			dt := uint64(dp[t/page]*page + t%page)
			e.Local = append(e.Local, uint64(src.Addr())+bf*toks*2*slice+st*2*slice+slice)
			e.Remote = append(e.Remote, uint64(dst.Addr())+bf*toks*slice+dt*slice)
			e.Length = append(e.Length, slice)
		}
	}
	b.SetBytes(bufs * toks * slice)
	// One untimed batch first: the fresh buffers' first touch (page
	// faults on both sides) is not what the shapes are compared on.
	for i := -1; i < b.N; i++ {
		if i == 0 {
			b.ResetTimer()
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		id, err := seg.SubmitEntries(ctx, transport.OpWrite, e)
		if err != nil {
			b.Fatal(err)
		}
		if st, _ := seg.Wait(ctx, id); st.State != transport.BatchCompleted {
			b.Fatal(st.Err)
		}
		seg.Release(id)
		cancel()
	}
}
