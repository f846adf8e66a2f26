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
