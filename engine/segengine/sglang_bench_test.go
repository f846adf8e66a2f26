package segengine_test

import (
	"context"
	"crypto/sha256"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/shm"
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
//
// The tokens and pages sub-benchmarks run at different moments, so on a
// loaded machine their ratio moves with the load; BenchmarkSGLangPairs
// is the steady figure.
func BenchmarkSGLang(b *testing.B) {
	for _, tr := range []string{"tcp", "shm"} {
		if err := transport.ProbeTransport(tr); err != nil {
			continue
		}
		b.Run(tr+"/tokens", func(b *testing.B) { benchSGLang(b, tr, false) })
		b.Run(tr+"/pages", func(b *testing.B) { benchSGLang(b, tr, true) })
	}
}

// BenchmarkSGLangPairs: BenchmarkSGLang's two batches on one segment,
// alternating: each op is one pair (a per-token batch, then the same bytes
// in page-sized entries), so both sides of a pair see the same load. It
// reports the median of the per-pair ratios (tokens-GB/s / pages-GB/s,
// "ratio"), their 25th and 75th percentiles ("ratio-p25", "ratio-p75"),
// each side's median GB/s, each side's median process CPU time per batch
// (user + system, both engines: "tokens-cpu-ms", "pages-cpu-ms"; less
// moved by the load than the GB/s, since what other processes take is not
// in it) and the 1-minute load average at the start and the end
// ("load-start", "load-end", from /proc/loadavg; 0 where it cannot be
// read). ns/op is one pair.
//
// On shm each op also times, after the engine's pair, the host's own copy
// ceiling: the same two shapes copied bare, with no engine, from the same
// source buffer into the same destination buffer (the receiver's memfd
// pages, through its own mapping) by shm.CopyBlocks, the non-temporal
// copy shm uses for these batches, on as many goroutines as shm copies
// them with (shm.DefaultCopyThreads, taking 1 MiB units in turn as shm's
// workers do), and once more by a plain copy() loop on those goroutines
// (ordinary stores: runtime.memmove, as shm copies batches under its
// StreamMinBytes and as python/bench.py's numpy copy). Each copy is one
// piece per entry run (entries of one length at constant strides: one per
// page and buffer for the per-token batch, as the engine's descriptors). It reports the median per-op ratio of the
// bare copies ("bare-ratio": CopyBlocks, "memmove-ratio": copy()), their
// tokens GB/s, and the median per-op quotient engine ratio / bare-ratio
// ("vs-bare"): 1 when the engine loses nothing to the per-token shape
// beyond what the copy itself loses on this host. The bare copies are
// checked once, before the timing, to write exactly the bytes the engine's
// batches write.
//
//	go test -run '^$' -bench SGLangPairs/tcp -benchtime 20x ./engine/segengine
//	go test -run '^$' -bench SGLangPairs/shm -benchtime 30x ./engine/segengine
func BenchmarkSGLangPairs(b *testing.B) {
	for _, tr := range []string{"tcp", "shm"} {
		if err := transport.ProbeTransport(tr); err != nil {
			continue
		}
		b.Run(tr, func(b *testing.B) {
			recv := newTE(b, tr)
			send := newTE(b, tr)
			seg, tokens, pages, dst, src := sglangSetupBufs(b, recv, send)
			defer seg.Close()
			const bytes = sglangBytes
			load0 := loadAvg1()
			// One untimed pair first (first touch of the fresh buffers).
			sglangBatch(b, seg, tokens)
			sglangBatch(b, seg, pages)
			var bareT, bareP bareCopy
			if tr == "shm" {
				bareT = newBareCopy(b, tokens, dst, src, shm.DefaultCopyThreads())
				bareP = newBareCopy(b, pages, dst, src, shm.DefaultCopyThreads())
				checkBare(b, seg, dst, tokens, bareT)
				checkBare(b, seg, dst, pages, bareP)
			}
			var ratios, tg, pg, tc, pc []float64
			var bareR, memR, vsBare, bareTG, memTG []float64
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				c0 := cpuTime()
				t := sglangBatch(b, seg, tokens)
				c1 := cpuTime()
				p := sglangBatch(b, seg, pages)
				c2 := cpuTime()
				tc = append(tc, (c1-c0).Seconds()*1e3)
				pc = append(pc, (c2-c1).Seconds()*1e3)
				tg = append(tg, bytes/t.Seconds()/1e9)
				pg = append(pg, bytes/p.Seconds()/1e9)
				ratios = append(ratios, p.Seconds()/t.Seconds())
				if tr != "shm" {
					continue
				}
				bt, bp := bareT.run(shm.CopyBlocks), bareP.run(shm.CopyBlocks)
				mt, mp := bareT.run(plainCopy), bareP.run(plainCopy)
				bareR = append(bareR, bp.Seconds()/bt.Seconds())
				memR = append(memR, mp.Seconds()/mt.Seconds())
				bareTG = append(bareTG, bytes/bt.Seconds()/1e9)
				memTG = append(memTG, bytes/mt.Seconds()/1e9)
				vsBare = append(vsBare, ratios[len(ratios)-1]/bareR[len(bareR)-1])
			}
			b.StopTimer()
			if tr == "shm" {
				b.ReportMetric(quantile(bareR, 0.5), "bare-ratio")
				b.ReportMetric(quantile(memR, 0.5), "memmove-ratio")
				b.ReportMetric(quantile(vsBare, 0.5), "vs-bare")
				b.ReportMetric(quantile(bareTG, 0.5), "bare-tokens-GB/s")
				b.ReportMetric(quantile(memTG, 0.5), "memmove-tokens-GB/s")
			}
			b.SetBytes(2 * bytes)
			b.ReportMetric(quantile(ratios, 0.5), "ratio")
			b.ReportMetric(quantile(ratios, 0.25), "ratio-p25")
			b.ReportMetric(quantile(ratios, 0.75), "ratio-p75")
			b.ReportMetric(quantile(tg, 0.5), "tokens-GB/s")
			b.ReportMetric(quantile(pg, 0.5), "pages-GB/s")
			b.ReportMetric(quantile(tc, 0.5), "tokens-cpu-ms")
			b.ReportMetric(quantile(pc, 0.5), "pages-cpu-ms")
			b.ReportMetric(load0, "load-start")
			b.ReportMetric(loadAvg1(), "load-end")
		})
	}
}

// sglangBytes is the bytes one SGLang batch moves (64 x 4096 x 1 KiB).
const sglangBytes = 64 * 4096 * 1024

// sglangSetup registers the shape's buffers (dst on recv, src on send),
// opens send's segment to recv and builds both entry sets: per token slot
// and page-sized (the same bytes, same random page tables).
func sglangSetup(b *testing.B, recv, send *segengine.TransferEngine) (*segengine.RemoteSegment, segengine.Entries, segengine.Entries) {
	seg, tokens, pages, _, _ := sglangSetupBufs(b, recv, send)
	return seg, tokens, pages
}

// sglangSetupBufs is sglangSetup, also returning the destination and source
// buffers.
func sglangSetupBufs(b *testing.B, recv, send *segengine.TransferEngine) (*segengine.RemoteSegment, segengine.Entries, segengine.Entries, *transport.HostBuffer, *transport.HostBuffer) {
	const bufs, toks, page, slice = 64, 4096, 64, 1024
	dst, _ := regBuf(b, recv, "dst", bufs*toks*slice)
	src, _ := regBuf(b, send, "src", bufs*toks*2*slice)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		b.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 2))
	sp, dp := r.Perm(toks/page), r.Perm(toks/page)
	tokens := segengine.Entries{Region: segengine.PeerAddressRegion}
	pages := segengine.Entries{Region: segengine.PeerAddressRegion}
	for bf := uint64(0); bf < bufs; bf++ {
		for p := 0; p < toks/page; p++ {
			pages.Local = append(pages.Local, uint64(src.Addr())+bf*toks*2*slice+uint64(sp[p]*page*slice))
			pages.Remote = append(pages.Remote, uint64(dst.Addr())+bf*toks*slice+uint64(dp[p]*page*slice))
			pages.Length = append(pages.Length, page*slice)
		}
		for t := 0; t < toks; t++ {
			st := uint64(sp[t/page]*page + t%page)
			dt := uint64(dp[t/page]*page + t%page)
			tokens.Local = append(tokens.Local, uint64(src.Addr())+bf*toks*2*slice+st*2*slice+slice)
			tokens.Remote = append(tokens.Remote, uint64(dst.Addr())+bf*toks*slice+dt*slice)
			tokens.Length = append(tokens.Length, slice)
		}
	}
	return seg, tokens, pages, dst, src
}

// bareCopy is a batch's bytes as pieces for a copy without an engine: one
// piece per run of entries of one length at constant local and remote
// strides, grouped into units of at most 1 MiB (shm's copy unit), copied
// by workers goroutines taking units in turn.
type bareCopy struct {
	dst, src []byte
	pieces   []barePiece
	units    []int // units[k] is the first piece of unit k; a last entry closes the list
	workers  int
}

// barePiece: n blocks of blk bytes, block j from src[srcOff+j*srcStride:]
// to dst[dstOff+j*dstStride:].
type barePiece struct {
	dstOff, srcOff, n, blk, dstStride, srcStride uint64
}

// newBareCopy builds e's pieces (e: local addresses in src, peer addresses
// in dst; one entry's run ends where the length or a stride changes).
func newBareCopy(b *testing.B, e segengine.Entries, dst, src *transport.HostBuffer, workers int) bareCopy {
	bc := bareCopy{dst: dst.Bytes(), src: src.Bytes(), workers: max(workers, 1)}
	sb, db := uint64(src.Addr()), uint64(dst.Addr())
	var unitBytes uint64
	for i := 0; i < len(e.Local); {
		p := barePiece{dstOff: e.Remote[i] - db, srcOff: e.Local[i] - sb, n: 1, blk: e.Length[i]}
		j := i + 1
		if j < len(e.Local) && e.Length[j] == p.blk && e.Local[j] > e.Local[i] && e.Remote[j] > e.Remote[i] {
			p.srcStride, p.dstStride = e.Local[j]-e.Local[i], e.Remote[j]-e.Remote[i]
			for ; j < len(e.Local) && e.Length[j] == p.blk && e.Local[j]-e.Local[j-1] == p.srcStride && e.Remote[j]-e.Remote[j-1] == p.dstStride; j++ {
				p.n++
			}
		}
		if p.srcStride < p.blk || p.dstStride < p.blk {
			p.n, p.srcStride, p.dstStride, j = 1, 0, 0, i+1 // overlapping blocks: one at a time
		}
		if len(bc.units) == 0 || unitBytes+p.n*p.blk > 1<<20 {
			bc.units = append(bc.units, len(bc.pieces))
			unitBytes = 0
		}
		unitBytes += p.n * p.blk
		bc.pieces = append(bc.pieces, p)
		i = j
	}
	bc.units = append(bc.units, len(bc.pieces))
	if len(bc.pieces) == 0 {
		b.Fatal("bare copy: no entries")
	}
	return bc
}

// plainCopy is shm.CopyBlocks' signature over a copy() loop: ordinary
// stores (runtime.memmove) per block.
func plainCopy(dst, src []byte, n, blk, dstStride, srcStride uint64) {
	for j := uint64(0); j < n; j++ {
		d, s := j*dstStride, j*srcStride
		copy(dst[d:d+blk], src[s:s+blk])
	}
}

// run copies every piece with cp on bc.workers goroutines (each taking the
// next 1 MiB unit) and returns the time from start to the last copy's end.
func (bc bareCopy) run(cp func(dst, src []byte, n, blk, dstStride, srcStride uint64)) time.Duration {
	var next atomic.Int64
	var wg sync.WaitGroup
	t0 := time.Now()
	for w := 0; w < bc.workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				k := int(next.Add(1) - 1)
				if k >= len(bc.units)-1 {
					return
				}
				for _, p := range bc.pieces[bc.units[k]:bc.units[k+1]] {
					cp(bc.dst[p.dstOff:], bc.src[p.srcOff:], p.n, p.blk, p.dstStride, p.srcStride)
				}
			}
		}()
	}
	wg.Wait()
	return time.Since(t0)
}

// checkBare fails b unless the bare copy bc (both its copies) writes into
// dst exactly what the engine's batch e writes there (dst cleared before
// each).
func checkBare(b *testing.B, seg *segengine.RemoteSegment, dst *transport.HostBuffer, e segengine.Entries, bc bareCopy) {
	d := dst.Bytes()
	clear(d)
	sglangBatch(b, seg, e)
	want := sha256.Sum256(d)
	for name, cp := range map[string]func(dst, src []byte, n, blk, dstStride, srcStride uint64){"shm.CopyBlocks": shm.CopyBlocks, "copy()": plainCopy} {
		clear(d)
		bc.run(cp)
		if sha256.Sum256(d) != want {
			b.Fatalf("bare copy by %s (%d pieces) does not write what the engine's batch of %d entries writes", name, len(bc.pieces), len(e.Local))
		}
	}
}

// sglangBatch submits e as one write batch, waits for it and returns the
// time from submit to completion.
func sglangBatch(b *testing.B, seg *segengine.RemoteSegment, e segengine.Entries) time.Duration {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	t0 := time.Now()
	id, err := seg.SubmitEntries(ctx, transport.OpWrite, e)
	if err != nil {
		b.Fatal(err)
	}
	if st, _ := seg.Wait(ctx, id); st.State != transport.BatchCompleted {
		b.Fatal(st.Err)
	}
	d := time.Since(t0)
	seg.Release(id)
	return d
}

// quantile returns the q-quantile (0..1, nearest rank) of xs; 0 for none.
func quantile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

// cpuTime is the process's CPU time so far (user + system, all threads);
// 0 where getrusage fails.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// loadAvg1 is the 1-minute load average from /proc/loadavg (0 where it
// cannot be read: not Linux).
func loadAvg1() float64 {
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(raw))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}

func benchSGLang(b *testing.B, tr string, pages bool) {
	recv := newTE(b, tr)
	send := newTE(b, tr)
	seg, tokens, paged := sglangSetup(b, recv, send)
	defer seg.Close()
	e := tokens
	if pages {
		e = paged
	}
	b.SetBytes(sglangBytes)
	// One untimed batch first: the fresh buffers' first touch (page
	// faults on both sides) is not what the shapes are compared on.
	sglangBatch(b, seg, e)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		sglangBatch(b, seg, e)
	}
}

// BenchmarkSGLangSubmit: the submit alone of BenchmarkSGLang's per-token
// batch (262,144 entries: SubmitEntries, what kvx_batch_submit_soa calls),
// each transfer waited for outside the timing. It reports the median
// submit in milliseconds ("submit-ms"), that per entry ("ns/entry"), and
// the median process CPU time of one submit ("submit-cpu-ms": getrusage,
// steadier than the wall time on a loaded machine) and the 1-minute load
// at the start ("load-start").
//
//	go test -run '^$' -bench SGLangSubmit -benchtime 20x -cpuprofile /tmp/submit.prof ./engine/segengine
func BenchmarkSGLangSubmit(b *testing.B) {
	for _, tr := range []string{"tcp", "shm"} {
		if err := transport.ProbeTransport(tr); err != nil {
			continue
		}
		b.Run(tr, func(b *testing.B) {
			recv := newTE(b, tr)
			send := newTE(b, tr)
			seg, tokens, _ := sglangSetup(b, recv, send)
			defer seg.Close()
			sglangBatch(b, seg, tokens)
			ctx := context.Background()
			load0 := loadAvg1()
			var wall, cpu []float64
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				c0, t0 := cpuTime(), time.Now()
				id, err := seg.SubmitEntries(ctx, transport.OpWrite, tokens)
				d, c := time.Since(t0), cpuTime()-c0
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				wall = append(wall, d.Seconds()*1e3)
				cpu = append(cpu, c.Seconds()*1e3)
				if st, _ := seg.Wait(ctx, id); st.State != transport.BatchCompleted {
					b.Fatal(st.Err)
				}
				seg.Release(id)
				b.StartTimer()
			}
			b.StopTimer()
			med := quantile(wall, 0.5)
			b.ReportMetric(med, "submit-ms")
			b.ReportMetric(med*1e6/float64(len(tokens.Local)), "ns/entry")
			b.ReportMetric(quantile(cpu, 0.5), "submit-cpu-ms")
			b.ReportMetric(load0, "load-start")
		})
	}
}
