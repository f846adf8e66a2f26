package tcp_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine/tcp"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// benchPair sets up a loopback sender/receiver with window bytes registered
// on each side and an open segment.
func benchPair(b *testing.B, streams, window int) (transport.Segment, *transport.HostBuffer, transport.RegionDesc) {
	b.Helper()
	o := transport.DefaultOptions()
	o.Streams = streams
	var trs [2]transport.Transport
	var bufs [2]*transport.HostBuffer
	var descs [2]transport.RegionDesc
	for i := range trs {
		tr, err := transport.OpenTransport("tcp", o)
		if err != nil {
			b.Fatal(err)
		}
		buf, err := transport.AllocHost("bench", int64(window))
		if err != nil {
			b.Fatal(err)
		}
		for j := 0; j < len(buf.Bytes()); j += 4096 { // fault the pages in
			buf.Bytes()[j] = byte(j)
		}
		d, err := tr.RegisterMemory(buf.Memory())
		if err != nil {
			b.Fatal(err)
		}
		trs[i], bufs[i], descs[i] = tr, buf, d
	}
	b.Cleanup(func() {
		trs[0].Close()
		trs[1].Close()
		bufs[0].Close()
		bufs[1].Close()
	})
	ep, err := trs[1].Endpoint(context.Background(), "bench")
	if err != nil {
		b.Fatal(err)
	}
	seg, err := trs[0].OpenSegment(context.Background(), transport.SegmentInfo{Endpoint: ep, Regions: []transport.RegionDesc{descs[1]}})
	if err != nil {
		b.Fatal(err)
	}
	return seg, bufs[0], descs[1]
}

// BenchmarkWrite measures loopback throughput: each op is one transfer batch
// of `blocks` contiguous requests of `block` bytes (64 MiB per batch),
// submitted and waited for. Reports GB/s (1e9 bytes/s).
func BenchmarkWrite(b *testing.B) {
	const window = 64 << 20
	for _, streams := range []int{1, 4} {
		for _, block := range []int{4 << 10, 64 << 10, 1 << 20, 16 << 20} {
			name := fmt.Sprintf("streams=%d/block=%s", streams, sizeName(block))
			b.Run(name, func(b *testing.B) {
				seg, src, dst := benchPair(b, streams, window)
				var tb transport.TransferBatch
				for off := 0; off < window; off += block {
					tb.Requests = append(tb.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(off), Remote: dst.ID, RemoteOffset: uint64(off), Length: uint64(block)})
				}
				ctx := context.Background()
				b.SetBytes(int64(tb.Bytes()))
				b.ReportAllocs()
				for b.Loop() {
					id, err := seg.Submit(ctx, &tb)
					if err != nil {
						b.Fatal(err)
					}
					st, err := seg.Wait(ctx, id)
					if err != nil || st.State != transport.BatchCompleted {
						b.Fatalf("batch: %v %v %v", st.State, st.Err, err)
					}
					seg.Release(id)
				}
				b.ReportMetric(float64(tb.Bytes())*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
			})
		}
	}
}

// BenchmarkStrided measures TP-slicing shaped writes: 4096 blocks of 256 B
// (one descriptor) per request, 16 requests per batch.
func BenchmarkStrided(b *testing.B) {
	seg, src, dst := benchPair(b, 4, 64<<20)
	var tb transport.TransferBatch
	for i := 0; i < 16; i++ {
		tb.Requests = append(tb.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(i)<<20, Remote: dst.ID, RemoteOffset: uint64(i) << 21,
			Length: 256, Count: 4096, LocalStride: 256, RemoteStride: 512})
	}
	ctx := context.Background()
	b.SetBytes(int64(tb.Bytes()))
	b.ReportAllocs()
	for b.Loop() {
		id, err := seg.Submit(ctx, &tb)
		if err != nil {
			b.Fatal(err)
		}
		if st, err := seg.Wait(ctx, id); err != nil || st.State != transport.BatchCompleted {
			b.Fatalf("batch: %v %v %v", st.State, st.Err, err)
		}
		seg.Release(id)
	}
	b.ReportMetric(float64(tb.Bytes())*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// BenchmarkPipelined measures many small batches in flight: each batch is
// one request of `block` bytes, `depth` batches are kept in flight (the
// shape of a KV sender posting page runs as separate batches).
func BenchmarkPipelined(b *testing.B) {
	const window = 64 << 20
	for _, block := range []int{64 << 10, 1 << 20} {
		for _, depth := range []int{1, 8} {
			b.Run(fmt.Sprintf("block=%s/depth=%d", sizeName(block), depth), func(b *testing.B) {
				seg, src, dst := benchPair(b, tcp.DefaultStreams, window)
				ctx := context.Background()
				slots := window / block
				inflight := make([]transport.BatchID, 0, depth)
				next := 0
				submit := func() {
					off := (next % slots) * block
					next++
					id, err := seg.Submit(ctx, &transport.TransferBatch{Requests: []transport.WriteRequest{{Local: src.Addr() + uintptr(off), Remote: dst.ID, RemoteOffset: uint64(off), Length: uint64(block)}}})
					if err != nil {
						b.Fatal(err)
					}
					inflight = append(inflight, id)
				}
				wait := func() {
					id := inflight[0]
					inflight = inflight[1:]
					if st, err := seg.Wait(ctx, id); err != nil || st.State != transport.BatchCompleted {
						b.Fatalf("batch: %v %v %v", st.State, st.Err, err)
					}
					seg.Release(id)
				}
				b.SetBytes(int64(block))
				b.ReportAllocs()
				for b.Loop() {
					if len(inflight) == depth {
						wait()
					}
					submit()
				}
				for len(inflight) > 0 {
					wait()
				}
				b.ReportMetric(float64(block)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
			})
		}
	}
}

// BenchmarkScattered measures the KV-page shape: each op is one transfer
// batch of `depth` requests of `block` bytes whose remote slots are a random
// permutation of the window (nothing is contiguous), two batches in flight,
// as `kvxfer bench` runs them. Besides GB/s it reports cpu-ns/B, the
// process's user+system CPU time per payload byte (getrusage), which moves
// far less than GB/s when the machine is shared.
func BenchmarkScattered(b *testing.B) {
	for _, block := range []int{4 << 10, 32 << 10, 1 << 20} {
		for _, depth := range []int{1, 256} {
			b.Run(fmt.Sprintf("block=%s/depth=%d", sizeName(block), depth), func(b *testing.B) {
				window := min(block*depth*2, 128<<20)
				seg, src, dst := benchPair(b, tcp.DefaultStreams, window)
				ctx := context.Background()
				slots := window / block
				perm := rand.New(rand.NewPCG(1, 2)).Perm(slots)
				batches := make([]*transport.TransferBatch, max(1, slots/depth))
				for k := range batches {
					tb := &transport.TransferBatch{}
					for j := 0; j < depth; j++ {
						i := (k*depth + j) % slots
						tb.Requests = append(tb.Requests, transport.WriteRequest{Local: src.Addr() + uintptr(i*block), Remote: dst.ID,
							RemoteOffset: uint64(perm[i] * block), Length: uint64(block)})
					}
					batches[k] = tb
				}
				var q []transport.BatchID
				wait := func() {
					if st, err := seg.Wait(ctx, q[0]); err != nil || st.State != transport.BatchCompleted {
						b.Fatalf("batch: %v %v %v", st.State, st.Err, err)
					}
					seg.Release(q[0])
					q = q[1:]
				}
				b.SetBytes(int64(block * depth))
				b.ReportAllocs()
				cpu0 := cpuTime()
				next := 0
				for b.Loop() {
					if len(q) == 2 {
						wait()
					}
					id, err := seg.Submit(ctx, batches[next%len(batches)])
					if err != nil {
						b.Fatal(err)
					}
					next++
					q = append(q, id)
				}
				for len(q) > 0 {
					wait()
				}
				bytes := float64(block*depth) * float64(b.N)
				b.ReportMetric(bytes/b.Elapsed().Seconds()/1e9, "GB/s")
				b.ReportMetric(float64((cpuTime()-cpu0).Nanoseconds())/bytes, "cpu-ns/B")
			})
		}
	}
}

// cpuTime is the process's user+system CPU time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkReadVsWrite measures one-sided READ beside WRITE on loopback with
// the same batches (64 MiB of `block`-byte requests, 4 streams): GB/s and
// the process CPU time per GB moved (user+system, both ends: steadier than
// GB/s on a loaded host).
func BenchmarkReadVsWrite(b *testing.B) {
	const window = 64 << 20
	for _, block := range []int{64 << 10, 1 << 20} {
		for _, op := range []transport.Op{transport.OpWrite, transport.OpRead} {
			b.Run(fmt.Sprintf("block=%s/op=%v", sizeName(block), op), func(b *testing.B) {
				seg, local, remote := benchPair(b, 4, window)
				tb := transport.TransferBatch{Op: op}
				for off := 0; off < window; off += block {
					tb.Requests = append(tb.Requests, transport.WriteRequest{Local: local.Addr() + uintptr(off), Remote: remote.ID, RemoteOffset: uint64(off), Length: uint64(block)})
				}
				ctx := context.Background()
				b.SetBytes(int64(tb.Bytes()))
				cpu0 := cpuTime()
				for b.Loop() {
					id, err := seg.Submit(ctx, &tb)
					if err != nil {
						b.Fatal(err)
					}
					st, err := seg.Wait(ctx, id)
					if err != nil || st.State != transport.BatchCompleted {
						b.Fatalf("batch: %v %v %v", st.State, st.Err, err)
					}
					seg.Release(id)
				}
				gb := float64(tb.Bytes()) * float64(b.N) / 1e9
				b.ReportMetric(gb/b.Elapsed().Seconds(), "GB/s")
				b.ReportMetric(float64((cpuTime()-cpu0).Milliseconds())/gb, "cpu-ms/GB")
			})
		}
	}
}
