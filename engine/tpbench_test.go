package engine_test

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	_ "github.com/kvxfer/kvxfer/engine/shm"
	"github.com/kvxfer/kvxfer/engine/transport"
	"github.com/kvxfer/kvxfer/workload"
)

// llamaLike is Llama-3.1-8B's KV shape (32 layers, 8 KV heads of 128, bf16).
var llamaLike = workload.ModelConfig{Name: "llama-like", NumLayers: 32, NumKVHeads: 8, HeadDim: 128, DtypeBytes: 2}

// BenchmarkRoomTP measures whole rooms of a Llama-3.1-8B-shaped KV (4096
// tokens, page 4) from prefill TP 1 and TP 2 to a decode TP 1 in one
// process, on shm and tcp, without the demo's pattern fill and check: the
// engine and transport alone. It reports the room's GB/s (KV bytes over
// the decode's TRANSFER → Success) and, from the prefill timelines, the
// batches' own time and rate (issue 26 item 9: why TP 2→1 is slower).
//
//	go test -run '^$' -bench BenchmarkRoomTP -benchtime 10x ./engine
func BenchmarkRoomTP(b *testing.B) {
	for _, tr := range []string{"shm", "tcp"} {
		if err := transport.ProbeTransport(tr); err != nil {
			continue
		}
		for _, ptp := range []int{1, 2} {
			b.Run(fmt.Sprintf("%s/prefill-tp%d-decode-tp1", tr, ptp), func(b *testing.B) { benchRoomTP(b, tr, ptp) })
		}
	}
}

func benchRoomTP(b *testing.B, tr string, ptp int) {
	const pages = 1024 // 4096 tokens
	addr := startBootstrap(b)
	var pre []*rank
	for tp := 0; tp < ptp; tp++ {
		pre = append(pre, newRank(b, rankOpts{role: engine.RolePrefill, model: llamaLike, tp: ptp, tpRank: tp, pp: 1, addr: addr, pages: pages, transports: []string{tr}}))
	}
	dec := newRank(b, rankOpts{role: engine.RoleDecode, model: llamaLike, tp: 1, pp: 1, pages: pages, transports: []string{tr}})
	dpg, err := dec.pool.Alloc(pages)
	if err != nil {
		b.Fatal(err)
	}
	srcs := make([][]int32, ptp)
	for i, p := range pre {
		if srcs[i], err = p.pool.Alloc(pages); err != nil {
			b.Fatal(err)
		}
	}
	var bytes uint64
	var xfer, batchTime time.Duration
	var batches int
	var batchRates []float64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		room := uint64(1000 + i)
		r, err := dec.m.NewReceiver(addr, room)
		if err != nil {
			b.Fatal(err)
		}
		if err := r.Init(dpg); err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		var wg sync.WaitGroup
		for k, p := range pre {
			s, err := p.m.NewSender(room)
			if err != nil {
				b.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer s.Close()
				if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
					b.Errorf("sender: %s %v", st, s.Failure())
					return
				}
				if err := s.Send(srcs[k][:s.DstPages()], true); err != nil {
					b.Error(err)
					return
				}
				s.Wait(ctx, engine.KVSuccess)
			}()
		}
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			b.Fatalf("room %d: %s %v", room, st, r.Failure())
		}
		wg.Wait()
		cancel()
		mt := r.TransferMetric()
		bytes += mt.Bytes
		xfer += mt.Latency
		r.Close()
		for _, p := range pre {
			tl, _ := p.m.RoomTimeline(room)
			for _, e := range tl.Events {
				var n int
				var d time.Duration
				var ds string
				var rate float64
				if k, _ := fmt.Sscanf(e.Detail, "batch %d completed after %s (%f GB/s)", &n, &ds, &rate); k == 3 {
					if d, err = time.ParseDuration(ds); err == nil {
						batches++
						batchTime += d
						batchRates = append(batchRates, rate)
					}
				}
			}
		}
	}
	b.StopTimer()
	if xfer > 0 {
		b.ReportMetric(float64(bytes)/xfer.Seconds()/1e9, "GB/s")
	}
	b.ReportMetric(float64(xfer.Microseconds())/float64(b.N)/1000, "ms/room")
	if batches > 0 {
		sort.Float64s(batchRates)
		b.ReportMetric(float64(batchTime.Microseconds())/float64(b.N)/1000, "batch-ms/room")
		b.ReportMetric(batchRates[len(batchRates)/2], "batch-GB/s-p50")
	}
}
