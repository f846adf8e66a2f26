package engine_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/engine"
	_ "github.com/kvxfer/kvxfer/engine/shm"
	"github.com/kvxfer/kvxfer/engine/transport"
)

// BenchmarkLayerwiseHandover measures the handover of a layer-wise room
// (issue 24): a Llama-3.1-8B-shaped room of 4,096 tokens (16 MiB of KV per
// layer) whose first 31 layers were sent and written (Flush) before the
// clock starts; then the last layer's SendLayers, up to the decode's
// Success. Both ranks are in this process, so the two timelines share a
// clock; the phases reported (medians over b.N rooms, µs) are where the
// handover goes:
//
//	last-write-us   SendLayers → the last batch (the layer's pages, the aux
//	                row and the metadata record body) completed
//	commit-us       → the commit word's batch completed (0 when the commit
//	                rides in the last batch)
//	status-sent-us  → STATUS Success sent to the decode
//	status-recv-us  → the decode received it
//	check-us        → the decode verified the record
//	success-us      → the decode's room is Success
//	handover-us     SendLayers → Success, measured by the caller
//
//	go test -run '^$' -bench BenchmarkLayerwiseHandover -benchtime 20x ./engine
func BenchmarkLayerwiseHandover(b *testing.B) {
	for _, tr := range []string{"shm", "tcp"} {
		if err := transport.ProbeTransport(tr); err != nil {
			continue
		}
		b.Run(tr, func(b *testing.B) { benchHandover(b, tr) })
	}
}

// handoverPhases names the phases in order (the benchmark's metrics).
var handoverPhases = []string{"last-write-us", "commit-us", "status-sent-us", "status-recv-us", "check-us", "success-us"}

func benchHandover(b *testing.B, tr string) {
	const pages = 1024 // 4096 tokens at page 4: 16 MiB per layer, as the demo
	addr := startBootstrap(b)
	pre := newRank(b, rankOpts{role: engine.RolePrefill, model: llamaLike, tp: 1, pp: 1, addr: addr, pages: pages, transports: []string{tr}})
	dec := newRank(b, rankOpts{role: engine.RoleDecode, model: llamaLike, tp: 1, pp: 1, pages: pages, transports: []string{tr}})
	dpg, err := dec.pool.Alloc(pages)
	if err != nil {
		b.Fatal(err)
	}
	src, err := pre.pool.Alloc(pages)
	if err != nil {
		b.Fatal(err)
	}
	last := llamaLike.NumLayers - 1
	phases := make([][]float64, len(handoverPhases))
	var total []float64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		room := uint64(5000 + i)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		r, err := dec.m.NewReceiver(addr, room)
		if err != nil {
			b.Fatal(err)
		}
		if err := r.Init(dpg); err != nil {
			b.Fatal(err)
		}
		s, err := pre.m.NewSender(room)
		if err != nil {
			b.Fatal(err)
		}
		if st := s.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
			b.Fatalf("room %d: sender %s (%v)", room, st, s.Failure())
		}
		for l := 0; l < last; l++ {
			if err := s.SendLayers(src, l, l, nil); err != nil {
				b.Fatal(err)
			}
		}
		if err := s.Flush(ctx); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		t0 := time.Now()
		if err := s.SendLayers(src, last, last, nil); err != nil {
			b.Fatal(err)
		}
		if st := r.Wait(ctx, engine.KVSuccess); st != engine.KVSuccess {
			b.Fatalf("room %d: decode %s (%v)", room, st, r.Failure())
		}
		t1 := time.Now()
		b.StopTimer()
		s.Wait(ctx, engine.KVSuccess)
		cancel()
		total = append(total, float64(t1.Sub(t0).Microseconds()))
		ptl, _ := pre.m.RoomTimeline(room)
		dtl, _ := dec.m.RoomTimeline(room)
		at, err := handoverMarks(ptl, dtl, t0)
		if err != nil {
			b.Fatalf("room %d: %v\nprefill: %s\ndecode: %s", room, err, ptl, dtl)
		}
		if i == b.N-1 && os.Getenv("TMPDUMP") != "" {
			type ev struct {
				at     time.Time
				who, d string
			}
			var evs []ev
			for _, e := range ptl.Events {
				if !e.At.Before(t0) {
					evs = append(evs, ev{e.At, "P", e.Detail})
				}
			}
			for _, e := range dtl.Events {
				if !e.At.Before(t0) {
					evs = append(evs, ev{e.At, "D", e.Detail})
				}
			}
			slices.SortFunc(evs, func(a, b ev) int { return a.at.Compare(b.at) })
			for _, e := range evs {
				fmt.Printf("%8.1f %s %s\n", float64(e.at.Sub(t0).Nanoseconds())/1e3, e.who, e.d)
			}
		}
		prev := t0
		for k, t := range at {
			phases[k] = append(phases[k], float64(t.Sub(prev).Nanoseconds())/1e3)
			prev = t
		}
		s.Close()
		r.Close()
		b.StartTimer()
	}
	b.StopTimer()
	for k, name := range handoverPhases {
		b.ReportMetric(median(phases[k]), name)
	}
	b.ReportMetric(median(total), "handover-us")
}

// handoverMarks finds the phase ends of handoverPhases in the prefill's and
// the decode's timelines of one room, after t0 (commit's end is the last
// write's when the commit has no batch of its own).
func handoverMarks(ptl, dtl engine.RoomTimeline, t0 time.Time) ([]time.Time, error) {
	var completed []time.Time
	var statusSent, statusRecv, verified time.Time
	for _, e := range ptl.Events {
		switch {
		case e.At.Before(t0):
		case strings.HasPrefix(e.Detail, "batch ") && strings.Contains(e.Detail, " completed after "):
			completed = append(completed, e.At)
		case e.Detail == "STATUS Success sent":
			statusSent = e.At
		}
	}
	for _, e := range dtl.Events {
		switch {
		case e.Detail == "STATUS Success":
			statusRecv = e.At
		case e.Detail == "metadata record verified":
			verified = e.At
		}
	}
	if len(completed) == 0 || len(completed) > 2 || statusSent.IsZero() || statusRecv.IsZero() || verified.IsZero() || dtl.Finished.IsZero() {
		return nil, fmt.Errorf("timeline: %d batches completed after the last SendLayers (want 1 or 2), STATUS sent %v, received %v, record verified %v, finished %v",
			len(completed), !statusSent.IsZero(), !statusRecv.IsZero(), !verified.IsZero(), !dtl.Finished.IsZero())
	}
	commit := completed[len(completed)-1]
	return []time.Time{completed[0], commit, statusSent, statusRecv, verified, dtl.Finished}, nil
}

// median of xs (0 for none).
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}
