package segengine_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/segengine"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// submitEntries submits entries of op and waits for the batch.
func submitEntries(t *testing.T, seg *segengine.RemoteSegment, op transport.Op, e segengine.Entries) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id, err := seg.SubmitEntries(ctx, op, e)
	if err != nil {
		return err
	}
	defer seg.Release(id)
	st, err := seg.Wait(ctx, id)
	if err != nil {
		return err
	}
	if st.State != transport.BatchCompleted {
		return st.Err
	}
	return nil
}

// TestSubmitEntries: struct-of-arrays entries by peer address and by region
// move the bytes of each entry, writes and reads, on tcp and shm.
func TestSubmitEntries(t *testing.T) {
	for _, tn := range []string{"tcp", "shm"} {
		t.Run(tn, func(t *testing.T) {
			recv := newTE(t, tn)
			send := newTE(t, tn)
			dst, dd := regBuf(t, recv, "dst", 1<<20)
			src, _ := regBuf(t, send, "src", 1<<20)
			back, _ := regBuf(t, send, "back", 1<<20)
			fill(src.Bytes(), 5)
			seg, err := send.OpenSegment(context.Background(), recv.Name())
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			const n, blk = 300, 700
			var e segengine.Entries
			for i := 0; i < n; i++ {
				j := (i * 37) % n // scattered sources
				e.Local = append(e.Local, uint64(src.Addr())+uint64(j*blk*2))
				e.Remote = append(e.Remote, uint64(dst.Addr())+uint64(i*blk))
				e.Length = append(e.Length, blk)
			}
			e.Region = segengine.PeerAddressRegion
			if err := submitEntries(t, seg, transport.OpWrite, e); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < n; i++ {
				j := (i * 37) % n
				if !bytes.Equal(dst.Bytes()[i*blk:(i+1)*blk], src.Bytes()[j*blk*2:j*blk*2+blk]) {
					t.Fatalf("entry %d: bytes differ", i)
				}
			}
			// Read them back by region offset.
			r := segengine.Entries{Region: dd.ID}
			for i := 0; i < n; i++ {
				r.Local = append(r.Local, uint64(back.Addr())+uint64(i*blk))
				r.Remote = append(r.Remote, uint64(i*blk))
				r.Length = append(r.Length, blk)
			}
			if err := submitEntries(t, seg, transport.OpRead, r); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(back.Bytes()[:n*blk], dst.Bytes()[:n*blk]) {
				t.Fatal("read back: bytes differ")
			}
		})
	}
}

// TestSubmitEntriesRefused: bad entries fail naming the entry's index and
// the error's class, and nothing is written.
func TestSubmitEntriesRefused(t *testing.T) {
	recv := newTE(t, "tcp")
	send := newTE(t, "tcp")
	dst, dd := regBuf(t, recv, "dst", 1<<16)
	src, _ := regBuf(t, send, "src", 1<<16)
	fill(src.Bytes(), 9)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	s, d := uint64(src.Addr()), uint64(dst.Addr())
	peer := segengine.PeerAddressRegion
	for _, tc := range []struct {
		name string
		e    segengine.Entries
		want error
		text string
	}{
		{"zero length", segengine.Entries{Local: []uint64{s, s}, Remote: []uint64{d, d + 64}, Length: []uint64{64, 0}, Region: peer}, segengine.ErrBadEntry, "write 1: length is 0"},
		{"lengths differ", segengine.Entries{Local: []uint64{s, s}, Remote: []uint64{d}, Length: []uint64{64, 64}, Region: peer}, segengine.ErrBadEntry, "2 local addresses, 1 remote"},
		{"local unregistered", segengine.Entries{Local: []uint64{s, 0x1000}, Remote: []uint64{d, d + 64}, Length: []uint64{64, 64}, Region: peer}, segengine.ErrLocalNotRegistered, "write 1: local range"},
		{"local past its region", segengine.Entries{Local: []uint64{s + 1<<16 - 8}, Remote: []uint64{d}, Length: []uint64{64}, Region: peer}, segengine.ErrLocalNotRegistered, "write 0"},
		{"peer address outside", segengine.Entries{Local: []uint64{s, s}, Remote: []uint64{d, d + 1<<16 - 8}, Length: []uint64{64, 64}, Region: peer}, transport.ErrOutOfBounds, "write 1"},
		{"wraps", segengine.Entries{Local: []uint64{s}, Remote: []uint64{^uint64(0) - 3}, Length: []uint64{64}, Region: peer}, transport.ErrOutOfBounds, "wraps"},
		{"region offset past end", segengine.Entries{Local: []uint64{s, s}, Remote: []uint64{0, 1<<16 - 8}, Length: []uint64{64, 64}, Region: dd.ID}, transport.ErrOutOfBounds, "write 1 of 64 bytes at offset"},
		{"unknown region", segengine.Entries{Local: []uint64{s}, Remote: []uint64{0}, Length: []uint64{64}, Region: dd.ID + 77}, transport.ErrUnknownRegion, "not registered on the peer"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := submitEntries(t, seg, transport.OpWrite, tc.e)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("err = %v, want %v containing %q", err, tc.want, tc.text)
			}
			if !bytes.Equal(dst.Bytes()[:256], make([]byte, 256)) {
				t.Fatal("a refused batch wrote bytes")
			}
		})
	}
}

// TestSubmitCoalesces: SGLang's per-token-slot batch with prefill TP 1 and
// decode TP 2 (a 256-byte head slice of each 512-byte prefill token into
// a 256-byte decode token; pages of 16 tokens scattered on both sides)
// reaches the transport as one strided descriptor per page, and a batch of
// adjacent pages as one request; the bytes are those of the entries, and
// the engine's counts (CoalesceStats, the metrics) say so. Region-addressed
// Submit coalesces too.
func TestSubmitCoalesces(t *testing.T) {
	for _, tn := range []string{"tcp", "shm"} {
		t.Run(tn, func(t *testing.T) {
			recv := newTE(t, tn)
			send := newTE(t, tn)
			const pages, ptok, srcTok, slice = 8, 16, 512, 256
			dst, dd := regBuf(t, recv, "dst", pages*ptok*slice)
			src, _ := regBuf(t, send, "src", pages*ptok*srcTok)
			fill(src.Bytes(), 1)
			seg, err := send.OpenSegment(context.Background(), recv.Name())
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			srcPage := []int{5, 2, 7, 0, 3, 6, 1, 4}
			dstPage := []int{1, 6, 0, 4, 7, 2, 5, 3}
			e := segengine.Entries{Region: segengine.PeerAddressRegion}
			for p := 0; p < pages; p++ {
				for k := 0; k < ptok; k++ {
					e.Local = append(e.Local, uint64(src.Addr())+uint64((srcPage[p]*ptok+k)*srcTok+srcTok-slice)) // the second half of the heads
					e.Remote = append(e.Remote, uint64(dst.Addr())+uint64((dstPage[p]*ptok+k)*slice))
					e.Length = append(e.Length, slice)
				}
			}
			before := send.CoalesceStats()
			if err := submitEntries(t, seg, transport.OpWrite, e); err != nil {
				t.Fatal(err)
			}
			for p := 0; p < pages; p++ {
				for k := 0; k < ptok; k++ {
					s0 := (srcPage[p]*ptok+k)*srcTok + srcTok - slice
					d0 := (dstPage[p]*ptok + k) * slice
					if !bytes.Equal(dst.Bytes()[d0:d0+slice], src.Bytes()[s0:s0+slice]) {
						t.Fatalf("page %d token %d: bytes differ", p, k)
					}
				}
			}
			got := send.CoalesceStats()
			if in, out := got.Requests-before.Requests, got.Descriptors-before.Descriptors; in != pages*ptok || out != pages {
				t.Fatalf("%d requests became %d descriptors; want %d and %d (one strided descriptor per page)", in, out, pages*ptok, pages)
			}
			// Adjacent whole pages by region: one request.
			clear(dst.Bytes())
			var reqs []transport.WriteRequest
			for p := 0; p < pages; p++ {
				reqs = append(reqs, transport.WriteRequest{Local: src.Addr() + uintptr(p*ptok*slice), Remote: dd.ID, RemoteOffset: uint64(p * ptok * slice), Length: ptok * slice})
			}
			before = got
			ctx := context.Background()
			id, err := seg.Submit(ctx, &transport.TransferBatch{Requests: reqs})
			if err != nil {
				t.Fatal(err)
			}
			if st, _ := seg.Wait(ctx, id); st.State != transport.BatchCompleted {
				t.Fatalf("region write: %v %v", st.State, st.Err)
			}
			seg.Release(id)
			if !bytes.Equal(dst.Bytes(), src.Bytes()[:pages*ptok*slice]) {
				t.Fatal("adjacent pages: bytes differ")
			}
			got = send.CoalesceStats()
			if in, out := got.Requests-before.Requests, got.Descriptors-before.Descriptors; in != pages || out != 1 {
				t.Fatalf("%d adjacent requests became %d descriptors; want %d and 1", in, out, pages)
			}
		})
	}
}

// TestCoalesceMetrics: every accepted batch's request and descriptor
// counts reach the configured SubmitObserver (the C library's Prometheus
// counters) and CoalesceStats.
func TestCoalesceMetrics(t *testing.T) {
	var mu sync.Mutex
	var got []string
	observe := func(tr string, op transport.Op, requests, descriptors int) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, fmt.Sprintf("%s %s %d->%d", tr, op, requests, descriptors))
	}
	recv := newTE(t, "tcp")
	send := newTE(t, "tcp", func(c *segengine.TransferEngineConfig) { c.OnSubmit = observe })
	dst, _ := regBuf(t, recv, "dst", 1<<16)
	src, _ := regBuf(t, send, "src", 1<<16)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	e := segengine.Entries{Region: segengine.PeerAddressRegion}
	for i := uint64(0); i < 10; i++ {
		e.Local = append(e.Local, uint64(src.Addr())+i*64)
		e.Remote = append(e.Remote, uint64(dst.Addr())+i*64)
		e.Length = append(e.Length, 64)
	}
	if err := submitEntries(t, seg, transport.OpWrite, e); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 1 || got[0] != "tcp write 10->1" {
		t.Fatalf("observer saw %q, want one batch \"tcp write 10->1\"", got)
	}
	if st := send.CoalesceStats(); st.Requests != 10 || st.Descriptors != 1 {
		t.Fatalf("CoalesceStats %+v, want 10 requests as 1 descriptor", st)
	}
}

// BenchmarkResolveEntries: the per-entry cost of checking, translating and
// coalescing SGLang's per-token-slot shape (262,144 entries of one batch:
// 64 buffers x 4096 tokens, 16-byte slices here so the regions stay small).
func BenchmarkResolveEntries(b *testing.B) {
	recv := newTE(b, "tcp")
	send := newTE(b, "tcp")
	const bufs, toks, slice = 64, 4096, 16
	dst, _ := regBuf(b, recv, "dst", bufs*toks*slice)
	src, _ := regBuf(b, send, "src", bufs*toks*2*slice)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		b.Fatal(err)
	}
	defer seg.Close()
	e := segengine.Entries{Region: segengine.PeerAddressRegion}
	for i := uint64(0); i < bufs*toks; i++ {
		e.Local = append(e.Local, uint64(src.Addr())+i*2*slice)
		e.Remote = append(e.Remote, uint64(dst.Addr())+i*slice)
		e.Length = append(e.Length, slice)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c := transport.NewCoalescer(true, len(e.Local))
		if err := seg.ResolveEntries(context.Background(), transport.OpWrite, e, c.Add); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(e.Local)), "ns/entry")
}

// run builds n entries of length L from local address l and remote value r
// with strides ls and rs.
func run(n int, l, r, L, ls, rs uint64) (loc, rem, lens []uint64) {
	for k := uint64(0); k < uint64(n); k++ {
		loc = append(loc, l+k*ls)
		rem = append(rem, r+k*rs)
		lens = append(lens, L)
	}
	return loc, rem, lens
}

// TestSubmitEntriesRuns: runs of equal-length, equal-stride entries (checked
// by their first and last entry, emitted as descriptors directly) move the
// bytes of each entry on tcp and shm: strided on the local side, on the
// remote side, on both, adjacent on both, and a strided run past
// transport.CoalesceMaxStridedBytes (split); each becomes the descriptors
// the Coalescer would form.
func TestSubmitEntriesRuns(t *testing.T) {
	for _, tn := range []string{"tcp", "shm"} {
		t.Run(tn, func(t *testing.T) {
			recv := newTE(t, tn)
			send := newTE(t, tn)
			dst, dd := regBuf(t, recv, "dst", 16<<20)
			src, _ := regBuf(t, send, "src", 16<<20)
			seg, err := send.OpenSegment(context.Background(), recv.Name())
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			s, d := uint64(src.Addr()), uint64(dst.Addr())
			for i, tc := range []struct {
				name              string
				n                 int
				lo, ro, L, ls, rs uint64
				region            bool
				descriptors       uint64
			}{
				{"local strided", 64, 1024, 0, 1024, 2048, 1024, false, 1},
				{"remote strided", 64, 0, 512, 256, 256, 768, false, 1},
				{"both strided", 100, 8, 16, 100, 300, 200, false, 1},
				{"adjacent", 1000, 0, 0, 512, 512, 512, false, 1},
				{"by region", 64, 4096, 4096, 1024, 2048, 1024, true, 1},
				{"strided past the cap", 100, 0, 0, 64 << 10, 128 << 10, 64 << 10, false, 2},
			} {
				t.Run(tc.name, func(t *testing.T) {
					fill(src.Bytes(), byte(i+1))
					clear(dst.Bytes())
					e := segengine.Entries{Region: segengine.PeerAddressRegion}
					base := d
					if tc.region {
						e.Region, base = dd.ID, 0
					}
					e.Local, e.Remote, e.Length = run(tc.n, s+tc.lo, base+tc.ro, tc.L, tc.ls, tc.rs)
					before := send.CoalesceStats()
					if err := submitEntries(t, seg, transport.OpWrite, e); err != nil {
						t.Fatal(err)
					}
					got := send.CoalesceStats()
					if in, out := got.Requests-before.Requests, got.Descriptors-before.Descriptors; in != uint64(tc.n) || out != tc.descriptors {
						t.Fatalf("CoalesceStats: %d requests as %d descriptors, want %d as %d", in, out, tc.n, tc.descriptors)
					}
					want := make([]byte, len(dst.Bytes()))
					for k := uint64(0); k < uint64(tc.n); k++ {
						l, r := tc.lo+k*tc.ls, tc.ro+k*tc.rs
						copy(want[r:r+tc.L], src.Bytes()[l:l+tc.L])
					}
					if !bytes.Equal(dst.Bytes(), want) {
						t.Fatal("bytes differ from the entries'")
					}
				})
			}
		})
	}
}

// TestSubmitEntriesRunsRefused: a run is accepted only when every entry is
// inside what was registered: a run whose last entry leaves the local
// registration or the peer's region, one whose middle entries fall in a
// gap between two local registrations (first and last each inside one),
// and one that wraps the address space fail naming the first bad entry,
// with nothing written; a run across two abutting registrations is
// resolved entry by entry and moves its bytes.
func TestSubmitEntriesRunsRefused(t *testing.T) {
	recv := newTE(t, "tcp")
	send := newTE(t, "tcp")
	dst, dd := regBuf(t, recv, "dst", 1<<16)
	// One allocation registered as three parts: [0, 16K) and [16K, 32K)
	// abutting, then a 16K gap, then [48K, 64K).
	buf, err := transport.AllocHost("src", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { buf.Close() })
	for _, p := range [][2]uint64{{0, 16 << 10}, {16 << 10, 16 << 10}, {48 << 10, 16 << 10}} {
		m := buf.Memory()
		m.Addr += uintptr(p[0])
		m.Length = p[1]
		m.FDOffset += p[0]
		if _, err := send.RegisterMemory(m); err != nil {
			t.Fatal(err)
		}
	}
	fill(buf.Bytes(), 3)
	seg, err := send.OpenSegment(context.Background(), recv.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Close()
	s, d := uint64(buf.Addr()), uint64(dst.Addr())
	peer := segengine.PeerAddressRegion
	entries := func(region transport.RegionID, n int, l, r, L, ls, rs uint64) segengine.Entries {
		e := segengine.Entries{Region: region}
		e.Local, e.Remote, e.Length = run(n, l, r, L, ls, rs)
		return e
	}
	// Strides of 2^63: the third entry's address wraps back to the first's.
	wrapLocal := entries(peer, 3, s, d, 1024, 1<<63, 1024)
	wrapRemote := entries(peer, 3, s, d, 1024, 1024, 1<<63)
	for _, tc := range []struct {
		name string
		e    segengine.Entries
		want error
		text string
	}{
		{"last entry past the local registration", entries(peer, 8, s+(48<<10), d, 1024, 2300, 1024), segengine.ErrLocalNotRegistered, "write 7: local range"},
		{"middle entries in a local gap", entries(peer, 5, s+(16<<10), d, 1024, 12<<10, 1024), segengine.ErrLocalNotRegistered, "write 2: local range"},
		{"last entry past the peer's region", entries(peer, 8, s, d+(1<<16)-7*1024-1000, 1024, 1024, 1024), transport.ErrOutOfBounds, "write 7"},
		{"last offset past the region's end", entries(dd.ID, 8, s, (1<<16)-7*1024-1000, 1024, 1024, 1024), transport.ErrOutOfBounds, "write 7 of 1024 bytes at offset"},
		{"local stride wraps", wrapLocal, segengine.ErrLocalNotRegistered, "write 1: local range"},
		{"remote stride wraps", wrapRemote, transport.ErrOutOfBounds, "write 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := submitEntries(t, seg, transport.OpWrite, tc.e)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Fatalf("err = %v, want %v containing %q", err, tc.want, tc.text)
			}
			if !bytes.Equal(dst.Bytes(), make([]byte, 1<<16)) {
				t.Fatal("a refused batch wrote bytes")
			}
		})
	}
	// Across the abutting registrations [0, 16K) and [16K, 32K): valid.
	e := entries(peer, 16, s+(8<<10), d, 1024, 1024, 1024)
	if err := submitEntries(t, seg, transport.OpWrite, e); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst.Bytes()[:16<<10], buf.Bytes()[8<<10:24<<10]) {
		t.Fatal("run across abutting registrations: bytes differ")
	}
}
