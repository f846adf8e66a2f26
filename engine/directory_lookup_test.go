package engine_test

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/bootstrap/server"
	"github.com/kvxfer/kvxfer/engine"
)

// countingDirectory serves a real bootstrap server's handler on loopback
// and counts GET /route requests by kind (topology or per-rank, keyed by
// query) and accepted TCP connections.
type countingDirectory struct {
	addr  string
	topo  atomic.Int64
	conns atomic.Int64
	mu    sync.Mutex
	ranks map[string]int
}

func startCountingDirectory(t *testing.T) *countingDirectory {
	t.Helper()
	d := &countingDirectory{ranks: map[string]int{}}
	h := server.New(server.Options{Logger: slog.New(slog.DiscardHandler)}).Handler()
	hs := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && r.URL.Path == "/route" {
			if r.URL.Query().Get("prefill_dp_rank") == "-1" {
				d.topo.Add(1)
			} else {
				d.mu.Lock()
				d.ranks[r.URL.RawQuery]++
				d.mu.Unlock()
			}
		}
		h.ServeHTTP(w, r)
	}))
	hs.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			d.conns.Add(1)
		}
	}
	hs.Start()
	t.Cleanup(hs.Close)
	d.addr = strings.TrimPrefix(hs.URL, "http://")
	return d
}

// TestColdBurstCoalescesLookups is issue 13's cold decode burst: 300 rooms
// arrive at once at a decode that has never resolved this prefill
// instance. Identical directory lookups in flight are shared: one topology
// query and one query per prefill rank, over a bounded number of
// connections.
func TestColdBurstCoalescesLookups(t *testing.T) {
	d := startCountingDirectory(t)

	for tp := range 2 {
		newRank(t, rankOpts{role: engine.RolePrefill, model: smallGQA, tp: 2, tpRank: tp, pp: 1, addr: d.addr})
	}
	dec := newRank(t, rankOpts{role: engine.RoleDecode, model: smallGQA, tp: 1, pp: 1, bootHB: -1})
	const rooms = 300
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	recvs := make([]*engine.Receiver, rooms)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range recvs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			r, err := dec.m.NewReceiver(d.addr, uint64(1000+i))
			if err != nil {
				t.Error(err)
				return
			}
			recvs[i] = r
		}()
	}
	close(start)
	wg.Wait()
	for _, r := range recvs {
		if r == nil {
			t.FailNow()
		}
		defer r.Close()
		if st := r.Wait(ctx, engine.KVWaitingForInput); st != engine.KVWaitingForInput {
			t.Fatalf("room %d: %s (%v), want WaitingForInput", r.Room(), st, r.Failure())
		}
	}
	d.mu.Lock()
	ranks := d.ranks
	d.mu.Unlock()
	t.Logf("%d rooms: %d topology queries, rank queries %v, %d connections", rooms, d.topo.Load(), ranks, d.conns.Load())
	if n := d.topo.Load(); n != 1 {
		t.Errorf("%d topology queries for %d concurrent rooms, want 1", n, rooms)
	}
	if len(ranks) != 2 {
		t.Errorf("rank queries %v, want the 2 prefill ranks", ranks)
	}
	for q, n := range ranks {
		if n != 1 {
			t.Errorf("rank query %s sent %d times, want 1", q, n)
		}
	}
	if n := d.conns.Load(); n > 8 {
		t.Errorf("%d connections to one directory, want at most 8", n)
	}
}
