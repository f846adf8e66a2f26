package tcp_test

import (
	"bytes"
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/transport"
)

// scatterPair is a loopback tcp sender and receiver (2 streams) with n
// bytes registered on each side: the open segment, the sender's buffer and
// the receiver's buffer and region.
func scatterPair(t *testing.T, n int64) (transport.Segment, *transport.HostBuffer, *transport.HostBuffer, transport.RegionDesc) {
	t.Helper()
	o := transport.DefaultOptions()
	o.Streams = 2
	var bufs [2]*transport.HostBuffer
	var descs [2]transport.RegionDesc
	var trs [2]transport.Transport
	for i := range trs {
		tr, err := transport.OpenTransport("tcp", o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tr.Close() })
		buf, err := transport.AllocHost("scatter", n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { buf.Close() })
		d, err := tr.RegisterMemory(buf.Memory())
		if err != nil {
			t.Fatal(err)
		}
		trs[i], bufs[i], descs[i] = tr, buf, d
	}
	ep, err := trs[1].Endpoint(context.Background(), "scatter")
	if err != nil {
		t.Fatal(err)
	}
	seg, err := trs[0].OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{descs[1]}})
	if err != nil {
		t.Fatal(err)
	}
	return seg, bufs[0], bufs[1], descs[1]
}

func runBatch(t *testing.T, seg transport.Segment, tb *transport.TransferBatch) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id, err := seg.Submit(ctx, tb)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := seg.Wait(ctx, id); err != nil || st.State != transport.BatchCompleted {
		t.Fatalf("batch: %+v, %v", st, err)
	}
	seg.Release(id)
}

// TestScatterStridedSources: small strided writes whose blocks are back to
// back on the receiver travel as scatter entries; their local blocks, at
// any stride (0: one source block repeated; under the block length:
// overlapping; the block length: back to back; over it: head slices), land
// block by block where a per-block copy puts them, beside single small
// writes in the same frames.
func TestScatterStridedSources(t *testing.T) {
	const n = 1 << 20
	seg, src, dst, d := scatterPair(t, n)
	s := src.Bytes()
	for i := range s {
		s[i] = byte(i*7 + i>>9)
	}
	reqs := []transport.WriteRequest{
		{Local: src.Addr() + 100, Length: 1024, Count: 8, LocalStride: 2048, RemoteStride: 1024, RemoteOffset: 0},
		{Local: src.Addr() + 40000, Length: 512, Count: 4, LocalStride: 0, RemoteStride: 512, RemoteOffset: 20000},
		{Local: src.Addr() + 60000, Length: 1024, Count: 4, LocalStride: 1024, RemoteStride: 1024, RemoteOffset: 30000},
		{Local: src.Addr() + 90000, Length: 1000, Count: 3, LocalStride: 600, RemoteStride: 1000, RemoteOffset: 50000},
		{Local: src.Addr() + 200000, Length: 4000, RemoteOffset: 70000},
		{Local: src.Addr() + 300001, Length: 256, Count: 200, LocalStride: 777, RemoteStride: 256, RemoteOffset: 100000},
	}
	want := make([]byte, n)
	for i := range reqs {
		r := &reqs[i]
		r.Remote = d.ID
		off := uint64(r.Local - src.Addr())
		for k := uint64(0); k < r.Blocks(); k++ {
			o := off + k*r.LocalStride
			copy(want[r.RemoteOffset+k*r.RemoteStride:], s[o:o+r.Length])
		}
	}
	runBatch(t, seg, &transport.TransferBatch{Requests: reqs})
	if got := dst.Bytes(); !bytes.Equal(got, want) {
		i := 0
		for got[i] == want[i] {
			i++
		}
		t.Fatalf("receiver's bytes differ from a per-block copy first at offset %d: %d, want %d", i, got[i], want[i])
	}
}

// TestScatterStridedSubmitAllocs: Submit of a batch of small strided
// writes (512 entries of 64 x 256 B head slices at a 512 B stride: 32,768
// blocks) allocates per entry, not per block: under 4 bytes per block
// (one slice header per block was 24).
func TestScatterStridedSubmitAllocs(t *testing.T) {
	const entries, blocks, blk = 512, 64, 256
	seg, src, _, d := scatterPair(t, 2*entries*blocks*blk)
	var tb transport.TransferBatch
	for i := uint64(0); i < entries; i++ {
		tb.Requests = append(tb.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(i*blocks*2*blk+blk), Remote: d.ID,
			RemoteOffset: i * blocks * blk, Length: blk, Count: blocks, LocalStride: 2 * blk, RemoteStride: blk})
	}
	runBatch(t, seg, &tb) // warm-up: the streams' iovec buffers grow once
	least := ^uint64(0)
	for range 3 {
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		id, err := seg.Submit(context.Background(), &tb)
		runtime.ReadMemStats(&m1)
		if err != nil {
			t.Fatal(err)
		}
		least = min(least, m1.TotalAlloc-m0.TotalAlloc)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		if st, err := seg.Wait(ctx, id); err != nil || st.State != transport.BatchCompleted {
			t.Fatalf("batch: %+v, %v", st, err)
		}
		cancel()
		seg.Release(id)
	}
	if per := float64(least) / (entries * blocks); per >= 4 {
		t.Fatalf("Submit allocated %d bytes for %d blocks in %d entries (%.1f per block); want under 4 per block", least, entries*blocks, entries, per)
	}
}
